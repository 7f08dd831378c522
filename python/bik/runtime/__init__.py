"""How compiled kernel code is built and loaded: the CPU extension (cpu_ext), the NVRTC JIT and
its disk cache (cuda_jit), the AOT fatbins (cuda_aot). Knows no op."""
