"""The study's apparatus, apart from the library: inputs (`workloads`), the timed competitors and
fusedkern variants (`providers`), CUDA-event timing (`timing`), sweeps (`sweeps`), the CLI
(`bench`, also `python -m fusedkern.bench`), results files and their provenance (`results`),
tables, figures and the analytic memory model. Needs the `study` extras for tables and figures."""
