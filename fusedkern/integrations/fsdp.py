"""fusedkern with a sharded LM head (DTensor, FSDP2): the public names of `fusedkern.sharded`, where the library's
losses find them too (`full_weights`); `call_as_forward` runs a loss as the head's forward under FSDP2's hooks."""

from fusedkern.sharded import call_as_forward, full_weights

__all__ = ["full_weights", "call_as_forward"]
