"""`python -m fusedkern.bench`: the short name of the study's benchmark CLI, `fusedkern.study.bench`."""

import sys

from fusedkern.study.bench import main

if __name__ == "__main__":
    sys.exit(main())
