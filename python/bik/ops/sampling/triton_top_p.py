"""The Triton sampler's statistics for rows with top-p < 1: the cut in a few passes, not 32.

top-p keeps z >= v_p, v_p the largest fp32 v whose mass M(v) = vocab_sum(bik_exp(z - m) over
the top-k-kept z >= v) reaches target = top_p * S (csrc/cpu/sampling.h: the CPU finds it by 32
bisection steps on the fp32 order key, each a pass over the row). Every M(v) here is that exact
sum, in the normaliser's order, so the search may probe any thresholds it likes: M is monotone
in v (a fixed-order sum of non-negative terms), so a probe with M >= target raises the lower
end of the key bracket [lo, hi) that holds v_p and one below target lowers the upper end. The
probes decide how many passes a row takes, never its cut: the CPU's bits.

Each pass reads the row once and probes LANES thresholds together. The first
TOP_P_SPREAD_PASSES are split over the row's normaliser groups: one launch of
``top_p_pass_kernel`` per pass, one program per (row, group),
each probing its group (its chunk sums ascending, as the contract folds them) and buffering
its group's bracket tokens. The row's last program to arrive (an acq_rel ticket) folds the G
group masses in ascending order from +0 -- the contract's fold of group totals -- and decides:

* before pass 0 (triton_groups.group_max_kernel): each group's max and invalid flag; m is their
  max (exact in any order);
* pass 0: a fixed grid m - 0.45 (k + 1)^2 (k < LANES - 2), m + log_min_p and -inf (giving S,
  so the target, and the min-p normaliser);
* then passes of one of two kinds, chosen per row on the device:
  - split: LANES keys evenly through [lo, hi), while each group writes its kept finite tokens
    with z in [lo, hi) in vocabulary order to its buffer (the first CANDIDATES of them);
  - candidates: once every group's buffer held its share of the old bracket and at most LANES
    tokens lie in the new one, their values are the probes. M only changes at kept tokens'
    values, so v_p is one of them (or lo): the largest probe with M >= target is v_p, and the
    row is done.
  Splits alone shrink any bracket of 2^32 keys to one in ceil(32 / log2(LANES + 1)) passes, so
  ``TOP_P_PASSES`` passes bound every row without a host sync (CUDA-graph safe): after the
  spread passes, one launch of ``top_p_finish_kernel`` gives each row still unsettled one
  program that walks its groups in turn through the remaining passes (the same probes, group
  masses folded in the same order, the same decisions); real logits settle within the spread
  passes. A settled row's programs return at once.

The logprob's normaliser is M at max(v_p, m + log_min_p), a probe's mass already. Within a
pass, a threshold at or below a tile's smallest kept z takes the tile's full chunk sums, one
above its largest takes +0 sums: the same terms folded in the same order, so the same sums. A
tile below every probe (most of the row once the bracket is near m) costs a load and a max.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bik.ops._normaliser_triton import bik_exp, bik_log, chunk_sums
from bik.ops.sampling.triton_common import (
    _from_key,
    _kept_k,
    _key,
    _tempered,
    row_log_min_p,
    row_slots,
    row_temperature,
    row_topk,
    topk_args,
)
from bik.runtime.triton_launch import launch

TOP_P_LANES = 16  # thresholds probed per pass
TOP_P_CANDIDATES = 256  # tokens of the bracket a split pass keeps for the candidates pass
# Passes spread over (row, group) programs; a row that needs more finishes on one program
# (real logits: 3-4 passes on SmolLM2's, bench/results; the bound below covers any row).
TOP_P_SPREAD_PASSES = 4


def _passes(lanes: int) -> int:
    """Pass 0, the split passes that take any bracket of 2^32 + 1 keys to one (each leaves at
    most ceil(span / (lanes + 1)) keys), and one candidates pass (it ends the search)."""
    span, splits = 2**32 + 1, 0
    while span > 1:
        span, splits = -(-span // (lanes + 1)), splits + 1
    return 1 + splits + 1


TOP_P_PASSES = _passes(TOP_P_LANES)


@triton.jit
def _lane(v, lanes, k, fill):
    """v[k] of a [LANES] vector (a max over one value and fills: exact)."""
    return tl.max(tl.where(lanes == k, v, fill), axis=0)


@triton.jit
def _group_probe_masses(x_row, g0, g_end, temp, vk, ik, m_safe, probes, lo_v, hi_v, collect,
                        cand_row, LANES: tl.constexpr, CANDIDATES: tl.constexpr,
                        CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr, NCH: tl.constexpr):
    """One normaliser group [g0, g_end): its total of triton_common.group_mass's terms at each
    of the LANES probes (its chunks folded by halves, the chunk sums ascending from +0), and
    the number of kept finite tokens with z in [lo_v, hi_v), the first CANDIDATES of them
    stored at cand_row in vocabulary order when ``collect``."""
    lanes = tl.arange(0, LANES)
    cols = tl.arange(0, CHUNK)[None, :]
    slots = tl.arange(0, NCH)
    group_total = tl.zeros((LANES,), tl.float32)
    n = tl.full((), 0, tl.int32)
    lowest = tl.min(probes, axis=0)
    for c0 in range(g0, g_end, CHUNK * NCH):
        offs = c0 + slots[:, None] * CHUNK + cols
        mask = offs < g_end
        z = _tempered(x_row, offs, mask, temp)
        kept = mask & _kept_k(z, offs, vk, ik)
        z_hi = tl.max(tl.max(tl.where(kept, z, float("-inf")), axis=1), axis=0)
        z_lo = tl.min(tl.min(tl.where(kept, z, float("inf")), axis=1), axis=0)
        if lowest <= z_hi:  # else every probe's sums are +0 here: no exp, nothing to add
            e = tl.where(kept, bik_exp(z - m_safe), 0.0)
            full = chunk_sums(e, NCH, CHUNK, LOG2_CHUNK)
            for k in tl.static_range(LANES):
                t = _lane(probes, lanes, k, float("-inf"))
                if t <= z_lo:
                    sums = full
                elif t > z_hi:
                    sums = tl.zeros((NCH,), tl.float32)
                else:
                    sums = chunk_sums(tl.where(z >= t, e, 0.0), NCH, CHUNK, LOG2_CHUNK)
                for c in tl.static_range(NCH):  # chunk sums in ascending order
                    s_c = tl.sum(tl.where(slots == c, sums, 0.0), axis=0)
                    group_total = group_total + tl.where(lanes == k, s_c, 0.0)
        if collect & (z_hi >= lo_v) & (z_lo < hi_v):
            inside = kept & (z > float("-inf")) & (z >= lo_v) & (z < hi_v)
            flat = tl.reshape(inside.to(tl.int32), (NCH * CHUNK,))
            pos = n + tl.cumsum(flat, axis=0) - 1
            tl.store(cand_row + pos, tl.reshape(z, (NCH * CHUNK,)),
                     mask=(flat != 0) & (pos < CANDIDATES))
            n = n + tl.sum(flat, axis=0)
    return group_total, n


@triton.jit
def _next_probes(cand_ptr, count_ptr, lo, hi, collect, G: tl.constexpr, LANES: tl.constexpr,
                 CANDIDATES: tl.constexpr):
    """The decision after a pass over the bracket [lo, hi): (probes, final). The candidates
    left in [lo, hi) when every group's buffer held its whole share of the old bracket and they
    fit the lanes (final: the next pass ends the search), else keys evenly through [lo, hi)."""
    lanes = tl.arange(0, LANES)
    idx = tl.arange(0, G * CANDIDATES)
    n_g = tl.load(count_ptr + idx // CANDIDATES, cache_modifier=".cg")
    held = idx % CANDIDATES < n_g
    cand = tl.load(cand_ptr + idx, mask=held, other=float("-inf"), cache_modifier=".cg")
    lo_v = _from_key(lo)
    inside = held & (cand >= lo_v) & (cand < _from_key(hi))
    all_held = tl.max(n_g, axis=0) <= CANDIDATES
    final = (collect & all_held & (tl.sum(inside.to(tl.int32), axis=0) <= LANES)).to(tl.int32)
    rank = tl.cumsum(inside.to(tl.int32), axis=0) - 1
    picked = tl.zeros((LANES,), tl.float32)
    for j in tl.static_range(LANES):
        c_j = tl.max(tl.where(inside & (rank == j), cand, float("-inf")), axis=0)
        # + 0.0 turns -0.0 into +0.0: the CPU's cut is the largest key of a value
        picked = tl.where(lanes == j, tl.where(c_j > float("-inf"), c_j + 0.0, lo_v), picked)
    span = hi - lo
    split = _from_key(lo + (span * (lanes + 1).to(tl.int64)) // (LANES + 1))
    return tl.where(final != 0, picked, split), final


@triton.jit
def _row_setup(row, top_p_ptr, min_p_ptr, ws_f, FW, ws_i, IW, G: tl.constexpr):
    """(m_safe, is_bad, v_min_p) of a top-p row from its groups' maxima and flags."""
    gmax, _, _, _, _, _, gbad, _, _ = row_slots(ws_f, FW, ws_i, IW, row, G)
    m = tl.max(tl.load(gmax + tl.arange(0, G)), axis=0)
    is_bad = (tl.max(tl.load(gbad + tl.arange(0, G)), axis=0) > 0) | (m == float("-inf"))
    m_safe = tl.where(is_bad, 0.0, m)
    return m_safe, is_bad, m_safe + row_log_min_p(min_p_ptr, row)


@triton.jit
def _pass_state(it, row, m_safe, v_min_p, probe_ptr, istate_ptr, LANES: tl.constexpr):
    """(probes, lo, hi) of pass ``it``: pass 0's fixed grid over the whole key range, or what
    the previous pass's decision stored."""
    lanes = tl.arange(0, LANES)
    if it == 0:
        step = (lanes + 1).to(tl.float32)
        probes = tl.where(lanes < LANES - 2, m_safe - 0.45 * (step * step),
                          tl.where(lanes == LANES - 2, v_min_p, float("-inf")))
        lo = _key(tl.full((), float("-inf"), tl.float32))  # M(lo) >= target > M(hi)
        hi = _key(m_safe) + 1
    else:
        probes = tl.load(probe_ptr + row * LANES + lanes, cache_modifier=".cg")
        lo = tl.load(istate_ptr + row * 3, cache_modifier=".cg")
        hi = tl.load(istate_ptr + row * 3 + 1, cache_modifier=".cg")
    return probes, lo, hi


@triton.jit
def _probe_group(x_row, g0, GROUP_LEN, group_row, temp, vk, ik, m_safe, probes, lo, hi,
                 collect, gmass_ptr, cand_ptr, count_ptr, LANES: tl.constexpr,
                 CANDIDATES: tl.constexpr, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr,
                 NCH: tl.constexpr):
    """The masses at the probes of the group from token g0 and its bracket tokens, stored for
    the decision."""
    masses_g, n_g = _group_probe_masses(
        x_row, g0, g0 + GROUP_LEN, temp, vk, ik, m_safe, probes, _from_key(lo), _from_key(hi),
        collect, cand_ptr + group_row * CANDIDATES, LANES, CANDIDATES, CHUNK, LOG2_CHUNK, NCH)
    tl.store(gmass_ptr + group_row * LANES + tl.arange(0, LANES), masses_g)
    tl.store(count_ptr + group_row, n_g)


@triton.jit
def _decide(it, row, top_p, m_safe, is_bad, v_min_p, probes, lo, hi, collect, probe_ptr,
            fstate_ptr, istate_ptr, gmass_ptr, cand_ptr, count_ptr, m_out, vlo_out, logs_out,
            bad_out, passes_ptr, G: tl.constexpr, LANES: tl.constexpr,
            CANDIDATES: tl.constexpr):
    """After pass ``it`` over every group of the row: fold the G group masses in ascending
    order from +0, narrow the bracket, pick the next probes and store the row's state and its
    results so far (final once the bracket is one key: no later pass runs)."""
    lanes = tl.arange(0, LANES)
    masses = tl.zeros((LANES,), tl.float32)
    for k in range(G):  # group totals in ascending order from +0
        masses = masses + tl.load(gmass_ptr + (row * G + k) * LANES + lanes,
                                  cache_modifier=".cg")
    if it == 0:
        s_all = _lane(masses, lanes, LANES - 1, float("-inf"))  # M(-inf) = S
        target = top_p * s_all
        lo_mass = s_all
        mass_min_p = _lane(masses, lanes, LANES - 2, float("-inf"))
        final = tl.full((), 0, tl.int32)
    else:
        target = tl.load(fstate_ptr + row * 3, cache_modifier=".cg")
        lo_mass = tl.load(fstate_ptr + row * 3 + 1, cache_modifier=".cg")
        mass_min_p = tl.load(fstate_ptr + row * 3 + 2, cache_modifier=".cg")
        final = tl.load(istate_ptr + row * 3 + 2, cache_modifier=".cg").to(tl.int32)
    keys = _key(probes)
    ok = masses >= target
    new_lo = tl.maximum(lo, tl.max(tl.where(ok, keys, lo), axis=0))
    lo_mass = tl.where(new_lo > lo,
                       tl.max(tl.where(ok & (keys == new_lo), masses, 0.0), axis=0), lo_mass)
    lo = new_lo
    hi = tl.minimum(hi, tl.min(tl.where(ok, hi, keys), axis=0))
    hi = tl.where(final != 0, lo + 1, hi)
    probes, final = _next_probes(cand_ptr + row * G * CANDIDATES, count_ptr + row * G, lo, hi,
                                 collect, G, LANES, CANDIDATES)
    tl.store(probe_ptr + row * LANES + lanes, probes)
    tl.store(istate_ptr + row * 3, lo)
    tl.store(istate_ptr + row * 3 + 1, hi)
    tl.store(istate_ptr + row * 3 + 2, final.to(tl.int64))
    tl.store(fstate_ptr + row * 3, target)
    tl.store(fstate_ptr + row * 3 + 1, lo_mass)
    tl.store(fstate_ptr + row * 3 + 2, mass_min_p)
    v_p = _from_key(lo)
    # The logprob's normaliser over the finally kept tokens (>= 1: the max's term is 1).
    norm = tl.where(v_p >= v_min_p, lo_mass, mass_min_p)
    tl.store(m_out, m_safe)
    tl.store(vlo_out, tl.maximum(v_p, v_min_p))
    tl.store(logs_out, bik_log(tl.where(is_bad, 1.0, norm)))
    tl.store(bad_out, is_bad.to(tl.int32))
    tl.store(passes_ptr + row, it + 1)


@triton.jit(do_not_specialize=["it"])
def top_p_pass_kernel(x_ptr, stride_x, GROUP_LEN, it, temp_ptr, vk_ptr, ik_ptr, top_p_ptr,
                      min_p_ptr, ws_f, FW, ws_i, IW, probe_ptr, fstate_ptr, istate_ptr,
                      gmass_ptr, cand_ptr, count_ptr, ticket_ptr, passes_ptr,
                      G: tl.constexpr, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr,
                      NCH: tl.constexpr, LANES: tl.constexpr, CANDIDATES: tl.constexpr,
                      TOPK: tl.constexpr):
    """Pass ``it`` of a top-p row's search, one program per (row, normaliser group). Each
    program probes its group and buffers its group's bracket tokens; the row's last program to
    arrive (a ticket) decides for the row (``_decide``). A settled row returns at once."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    top_p = tl.load(top_p_ptr + row)
    if top_p >= 1.0:  # triton_groups' group_mass_kernel takes rows without top-p
        return
    m_safe, is_bad, v_min_p = _row_setup(row, top_p_ptr, min_p_ptr, ws_f, FW, ws_i, IW, G)
    probes, lo, hi = _pass_state(it, row, m_safe, v_min_p, probe_ptr, istate_ptr, LANES)
    if lo + 1 >= hi:
        return
    collect = (it > 0) | (GROUP_LEN <= CANDIDATES)
    vk, ik = row_topk(vk_ptr, ik_ptr, row, TOPK)
    _probe_group(x_ptr + row * stride_x, g.to(tl.int64) * GROUP_LEN, GROUP_LEN, row * G + g,
                 row_temperature(temp_ptr, row), vk, ik, m_safe, probes, lo, hi, collect,
                 gmass_ptr, cand_ptr, count_ptr, LANES, CANDIDATES, CHUNK, LOG2_CHUNK, NCH)
    # Every thread's stores, then one release / acquire ticket per program: the row's last
    # program of this pass sees every group's masses and candidates.
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr + row, 1, sem="acq_rel", scope="gpu")
    if ticket == (it + 1) * G - 1:
        tl.debug_barrier()
        _, _, m_out, vlo_out, logs_out, _, _, bad_out, _ = row_slots(ws_f, FW, ws_i, IW, row, G)
        _decide(it, row, top_p, m_safe, is_bad, v_min_p, probes, lo, hi, collect, probe_ptr,
                fstate_ptr, istate_ptr, gmass_ptr, cand_ptr, count_ptr, m_out, vlo_out,
                logs_out, bad_out, passes_ptr, G, LANES, CANDIDATES)


@triton.jit(do_not_specialize=["first", "last"])
def top_p_finish_kernel(x_ptr, stride_x, GROUP_LEN, first, last, temp_ptr, vk_ptr, ik_ptr,
                        top_p_ptr, min_p_ptr, ws_f, FW, ws_i, IW, probe_ptr, fstate_ptr,
                        istate_ptr, gmass_ptr, cand_ptr, count_ptr, passes_ptr,
                        G: tl.constexpr, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr,
                        NCH: tl.constexpr, LANES: tl.constexpr, CANDIDATES: tl.constexpr,
                        TOPK: tl.constexpr):
    """Passes ``first`` .. ``last - 1`` of a row the spread passes left unsettled, one program
    per row walking its G groups in turn: the same probes, sums and decisions as the pass
    kernel (the groups' masses are folded in the same ascending order), so the same cut. A
    settled row (every row of real logits after a few passes) returns at once."""
    row = tl.program_id(0).to(tl.int64)
    top_p = tl.load(top_p_ptr + row)
    if top_p >= 1.0:
        return
    m_safe, is_bad, v_min_p = _row_setup(row, top_p_ptr, min_p_ptr, ws_f, FW, ws_i, IW, G)
    _, _, m_out, vlo_out, logs_out, _, _, bad_out, _ = row_slots(ws_f, FW, ws_i, IW, row, G)
    vk, ik = row_topk(vk_ptr, ik_ptr, row, TOPK)
    temp = row_temperature(temp_ptr, row)
    for it in range(first, last):
        tl.debug_barrier()  # the previous decision's stores, seen by every thread
        probes, lo, hi = _pass_state(it, row, m_safe, v_min_p, probe_ptr, istate_ptr, LANES)
        if lo + 1 < hi:
            for g in range(G):
                _probe_group(x_ptr + row * stride_x, g * GROUP_LEN, GROUP_LEN, row * G + g,
                             temp, vk, ik, m_safe, probes, lo, hi, True, gmass_ptr, cand_ptr,
                             count_ptr, LANES, CANDIDATES, CHUNK, LOG2_CHUNK, NCH)
            tl.debug_barrier()
            _decide(it, row, top_p, m_safe, is_bad, v_min_p, probes, lo, hi, True, probe_ptr,
                    fstate_ptr, istate_ptr, gmass_ptr, cand_ptr, count_ptr, m_out, vlo_out,
                    logs_out, bad_out, passes_ptr, G, LANES, CANDIDATES)


def launch_top_p_stats(logits, temperature, vk, ik, top_p, min_p, ws, *, chunk: int, nch: int,
                       num_warps: int, options: dict, passes: int = TOP_P_PASSES,
                       spread: int = TOP_P_SPREAD_PASSES) -> torch.Tensor:
    """The search for every top-p row, after triton_groups' group_max_kernel filled the
    workspace ``ws`` with each group's max and flag: ``spread`` launches of the pass kernel
    over every (row, group), then one launch of the finish kernel (one program per row) for
    the passes up to ``passes`` that a row still needs. Rows without top-p and settled rows
    return at once: no host sync, CUDA-graph safe. m, v_lo, log_s and bad are written into
    ``ws`` for the top-p rows. Returns the passes each took (int32 [B]; 0 for the others),
    which tests and benchmarks read."""
    b, v = logits.shape
    g = ws.groups
    dev = logits.device
    probes = torch.empty(b, TOP_P_LANES, dtype=torch.float32, device=dev)
    fstate = torch.empty(b, 3, dtype=torch.float32, device=dev)
    istate = torch.empty(b, 3, dtype=torch.int64, device=dev)
    gmass = torch.empty(b, g, TOP_P_LANES, dtype=torch.float32, device=dev)
    cand = torch.empty(b, g, TOP_P_CANDIDATES, dtype=torch.float32, device=dev)
    count = torch.zeros(b, g, dtype=torch.int32, device=dev)
    tickets = torch.zeros(b, dtype=torch.int32, device=dev)
    taken = torch.zeros(b, dtype=torch.int32, device=dev)
    common = (logits, logits.stride(0), v // g)
    row_args = (temperature, *topk_args(vk, ik, ws), top_p, min_p, *ws.args(), probes, fstate,
                istate, gmass, cand, count)
    consts = {"G": g, "CHUNK": chunk, "LOG2_CHUNK": chunk.bit_length() - 1, "NCH": nch,
              "LANES": TOP_P_LANES, "CANDIDATES": TOP_P_CANDIDATES, "TOPK": vk is not None,
              "num_warps": num_warps, **options}
    for it in range(min(spread, passes)):
        launch(top_p_pass_kernel, (b, g), *common, it, *row_args, tickets, taken, **consts)
    if passes > spread:
        launch(top_p_finish_kernel, (b,), *common, spread, passes, *row_args, taken, **consts)
    return taken
