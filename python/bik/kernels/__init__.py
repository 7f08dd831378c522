"""Kernel launchers. Each module owns one kernel family; the ops layer (bik.ops) validates
inputs and picks the module by backend. Triton modules are imported lazily so that bik
imports without triton and so that TRITON_INTERPRET is read when a kernel is first used."""
