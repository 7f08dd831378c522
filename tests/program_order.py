"""The Triton interpreter with every launch's programs run in a seeded shuffled order.

The interpreter runs a launch's programs one after another in grid order, so a kernel whose
programs meet through memory (SPLIT attention's tickets and fused fold, the sampler's top-p
passes, SPREAD's partials) is only ever checked with the first program first and the last
last. On a GPU any order happens. ``shuffled_programs(seed)`` keeps the interpreter's loop and
remaps the index it hands each program through a seeded permutation of the grid, so each
program still runs exactly once, in another order per seed. Interpreter process only
(TRITON_INTERPRET=1); used by tests/test_program_order.py.
"""

from __future__ import annotations

import contextlib
import random


@contextlib.contextmanager
def shuffled_programs(seed: int):
    from triton.runtime.interpreter import InterpreterBuilder

    rng = random.Random(seed)
    set_dim, set_idx = InterpreterBuilder.set_grid_dim, InterpreterBuilder.set_grid_idx
    launches: dict[int, list] = {}  # builder -> [order, programs handed out, grid]

    def grid_dim(self, nx, ny, nz):
        order = list(range(nx * ny * nz))
        rng.shuffle(order)
        launches[id(self)] = [order, 0, (nx, ny, nz)]
        set_dim(self, nx, ny, nz)

    def grid_idx(self, x, y, z):
        launch = launches[id(self)]
        order, i, (_, ny, nz) = launch
        launch[1] += 1
        flat = order[i]
        set_idx(self, flat // (ny * nz), (flat // nz) % ny, flat % nz)

    InterpreterBuilder.set_grid_dim, InterpreterBuilder.set_grid_idx = grid_dim, grid_idx
    try:
        yield
    finally:
        InterpreterBuilder.set_grid_dim, InterpreterBuilder.set_grid_idx = set_dim, set_idx
