"""One training step of a layout, simulated from plan_cost.py's terms: each stage's micro-batches
in the order torch's schedules run them, the collectives each waits for and the forward a checkpointed
backward runs again, activations sent between stages, what FSDP's and DDP's collectives hide behind
compute, the ranks sharing the cores; and the parts of memory alive at once at the step's peak.

Run:  python plan_step.py --hardware hw.json --layers 2 --dim 256 --ffn 1024 --pp 2 --dp-shard 2 --microbatches 2
      (hw.json: this machine, written by plan_measure.py --measure and --sweep)

plan_cost.py (the formulas) sits beside it: copy both. The standard library only.
Source: torch's own schedules (torch/distributed/pipelining/schedules.py), FSDP2's streams and
DDP's buckets (torch/distributed/fsdp/_fully_shard, torch/nn/parallel/distributed.py).
"""

import argparse
import json
import math
import os
import sys
from dataclasses import asdict

import plan_cost


def order(schedule: str, stages: int, stage: int, microbatches: int) -> list:
    """The forwards and backwards of a stage in the order torch's schedules run them."""
    if schedule == "GPipe":
        return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
    warm = min(microbatches, stages - stage)  # 1F1B: a warm-up, then one backward, one forward
    out, f = [("F", i) for i in range(warm)], warm
    for b in range(microbatches):
        out.append(("B", b))
        if f < microbatches:
            out.append(("F", f))
            f += 1
    return out


def simulate(plans: list, ranks_per_stage: int, cores: float) -> tuple:
    """Run the stages' plans side by side. A plan is a list of ('work', s): s seconds of compute
    at a rank's full speed; ('wait', s, part): a collective that blocks s seconds; ('send',
    key, link, s): a transfer that takes s seconds once the link is free; ('recv', key): wait
    for it. The ranks of every stage share `cores` cores (0: a device each): with k ranks
    computing, each runs at cores / k of its speed. Returns each stage's end and its seconds
    by part (compute, each wait's part, 'bubble' for receiving)."""
    n, now = len(plans), 0.0
    at, left, end = [0] * n, [None] * n, [None] * n
    arrive, free = {}, {}
    parts = [{"compute": 0.0, "bubble": 0.0} for _ in range(n)]
    if not cores:  # a device each: every step starts when its stage and its input are ready
        clock = [0.0] * n
        while None in end:
            for s in range(n):
                while end[s] is None:
                    if at[s] == len(plans[s]):
                        end[s] = clock[s]
                        break
                    step = plans[s][at[s]]
                    if step[0] == "recv":
                        if step[1] not in arrive:
                            break  # its sender has not sent it yet: another stage moves first
                        parts[s]["bubble"] += max(0.0, arrive[step[1]] - clock[s])
                        clock[s] = max(clock[s], arrive[step[1]])
                    elif step[0] == "send":  # one sender a link: its sends come in time order
                        start = max(clock[s], free.get(step[2], 0.0))
                        free[step[2]] = arrive[step[1]] = start + step[3]
                    else:
                        part = "compute" if step[0] == "work" else step[2]
                        parts[s][part] = parts[s].get(part, 0.0) + step[1]
                        clock[s] += step[1]
                    at[s] += 1
        return end, parts
    while None in end:
        moved = True
        while moved:  # everything that takes no time
            moved = False
            for s in range(n):
                if end[s] is not None:
                    continue
                if at[s] == len(plans[s]):
                    end[s], moved = now, True
                    continue
                step = plans[s][at[s]]
                if step[0] == "send":
                    start = max(now, free.get(step[2], 0.0))
                    free[step[2]] = arrive[step[1]] = start + step[3]
                elif step[0] == "recv" and arrive.get(step[1], math.inf) > now:
                    continue
                elif step[0] in ("work", "wait"):
                    if left[s] is None:
                        left[s] = step[1]
                    if left[s] > 1e-12:
                        continue
                    left[s] = None
                at[s] += 1
                moved = True
        live = [s for s in range(n) if end[s] is None]
        if not live:
            break
        busy = [s for s in live if plans[s][at[s]][0] == "work"]
        speed = min(1.0, cores / (len(busy) * ranks_per_stage)) if cores and busy else 1.0
        gaps = [left[s] / speed for s in busy]
        gaps += [left[s] for s in live if plans[s][at[s]][0] == "wait"]
        gaps += [arrive[plans[s][at[s]][1]] - now for s in live
                 if plans[s][at[s]][0] == "recv" and plans[s][at[s]][1] in arrive]
        gap = min(gaps)  # the plans are built so that some stage can always move
        for s in live:
            step = plans[s][at[s]]
            if step[0] == "work":
                left[s] -= gap * speed
                parts[s]["compute"] += gap
            elif step[0] == "wait":
                left[s] -= gap
                parts[s][step[2]] = parts[s].get(step[2], 0.0) + gap
            else:
                parts[s]["bubble"] += gap
        now += gap
    return end, parts


def ddp_exposed(hw: plan_cost.Hardware, lay: plan_cost.Layout, pol: plan_cost.Policy, backward: float,
                stage_bytes: float) -> float:
    """DDP's buckets (1 MiB first, then 25 MiB, last layers first) each all-reduced once
    backward has made it, one after another; with hw.overlap they run beside the backward
    and what ends after it shows, else all of it."""
    buckets, left, cap = [], stage_bytes, 2**20
    while left > 0:
        buckets.append(min(cap, left))
        left -= buckets[-1]
        cap = 25 * 2**20
    end, made = 0.0, 0.0
    for size in buckets:
        made += size
        ready = backward * made / stage_bytes if hw.overlap else backward
        gap = max(0.0, ready - end)  # the link rested since the last bucket
        end = max(end, ready) + plan_cost.collective(hw, lay, "all_reduce", size, ("dp_replicate",), gap=gap)
    return max(0.0, end - backward)


def blocking(m: plan_cost.Model, lay: plan_cost.Layout, pol: plan_cost.Policy, hw: plan_cost.Hardware,
             rows: int, seq: int, stage: int, work: dict) -> dict:
    """Seconds of the collectives a micro-batch's forward and backward wait for (work: its
    plan_cost.microbatch on this stage). TP (sequence parallel) gathers the stream before
    attention and the MLP and reduce-scatters after them, the backward the other way round; CP
    gathers keys and values and reduce-scatters their gradients; EP sends its counts (int64),
    then rows to their experts and back; under CP a mixture's balancing loss sums each
    sequence's choices (int64, sequences x experts); loss_parallel all-reduces three numbers a
    token (the largest logit, the sum of exponentials, the target's logit; float32 at least).
    Between two calls the ranks compute (all of them at once: at cores / ranks of full speed)."""
    t, cp, B, d = lay.tp, lay.cp, pol.compute, m.dim
    tokens, per = rows * seq // cp, -(-m.layers // lay.pp)
    x_bytes, kv_bytes = tokens * d * B, rows * seq * m.kv_dim // t * B
    last = stage == lay.pp - 1
    split_loss = lay.loss_parallel and t > 1 and last
    calls = (per * (4 * (t > 1) + 2 * (cp > 1) + 3 * (lay.ep > 1) + (cp > 1 and m.experts > 0))
             + 3 * (t > 1) + 3 * split_loss)
    slow = max(1.0, lay.world / hw.cores) if hw.cores else 1.0
    gf, gb = work["forward"] * slow / max(1, calls), work["backward"] * slow / max(1, calls)

    def tp(kind, calls_, gap, size=x_bytes):
        return plan_cost.collective(hw, lay, kind, size, ("tp",), calls_, gap=gap)
    fwd = (tp("all_gather", 2 * per, gf) + tp("reduce_scatter", 2 * per, gf)
           + plan_cost.collective(hw, lay, "all_gather", kv_bytes, ("cp",), 2 * per, gap=gf))
    bwd = (tp("all_gather", 2 * per, gb) + tp("reduce_scatter", 2 * per, gb)
           + plan_cost.collective(hw, lay, "reduce_scatter", kv_bytes, ("cp",), 2 * per, gap=gb))
    if m.experts:
        sent = tokens * m.top_k * d * B
        fwd += (plan_cost.collective(hw, lay, "all_to_all", m.experts * 8, ("ep",), per, gap=gf)
                + plan_cost.collective(hw, lay, "all_to_all", sent, ("ep",), 2 * per, gap=gf)
                + plan_cost.collective(hw, lay, "all_reduce", rows * m.experts * 8, ("cp",), per, gap=gf))
        bwd += plan_cost.collective(hw, lay, "all_to_all", sent, ("ep",), 2 * per, gap=gb)
    if stage == 0:  # the embedding: its output reduce-scattered over tp, the gradient gathered
        fwd += tp("reduce_scatter", 1, gf)
        bwd += tp("all_gather", 1, gb)
    if last:  # the head's input gathered; the vocabulary-sharded logits kept split, or gathered whole
        fwd += tp("all_gather", 1, gf) + (tp("all_reduce", 3, gf, tokens * max(B, 4)) if split_loss
                                          else tp("all_gather", 1, gf, tokens * m.vocab * B))
        bwd += tp("reduce_scatter", 1, gb)
    return {"forward": fwd, "backward": bwd}


def microbatch_times(m: plan_cost.Model, lay: plan_cost.Layout, pol: plan_cost.Policy, hw: plan_cost.Hardware,
                     rows: int, seq: int, stage: int) -> dict:
    """One micro-batch of a stage as the step runs it: plan_cost.microbatch's compute and the
    collectives it waits for (blocking). Under activation checkpointing the backward runs the
    forward again, its calls too (selective: every other block's, as plan_cost.activations)."""
    work = plan_cost.microbatch(m, lay, pol, hw, rows, seq, stage)
    calls = blocking(m, lay, pol, hw, rows, seq, stage, work)
    redo = {"none": 0.0, "selective": 0.5, "full": 1.0}[lay.ac]  # of the forward, run again
    return {"forward": work["forward"], "backward": work["backward"] + redo * work["forward"],
            "forward_comm": calls["forward"], "backward_comm": calls["backward"] + redo * calls["forward"],
            "send": work["send"]}


def step(m: plan_cost.Model, lay: plan_cost.Layout, pol: plan_cost.Policy, hw: plan_cost.Hardware,
         batch: int, seq: int) -> dict:
    """Seconds of one optimizer step on the rank that ends last, by part. Each stage's
    micro-batches run in the schedule's order, a pipeline's activations cross the link
    between stages, and ranks share hw.cores (simulate). The overlap rule: TP, CP and EP
    collectives block; FSDP's gathers and reductions run beside compute on their own streams
    (hw.streams, a GPU) and block otherwise (gloo: every call waits); DDP's bucket
    all-reduces run beside the backward where the link, not a core, is busy (hw.overlap).
    Gradients are reduced once a step, after the last backward (accumulation steps add up
    where they are; a pipeline runs them as more micro-batches of its one schedule)."""
    mb = lay.passes
    rows = batch // lay.data_parallel // mb
    per = -(-m.layers // lay.pp)
    cost = [microbatch_times(m, lay, pol, hw, rows, seq, s) for s in range(lay.pp)]
    fsdp_axes = ("dp_shard", "cp", "ep")
    shard_n = math.prod(getattr(lay, a) for a in fsdp_axes)
    slow = max(1.0, lay.world / hw.cores) if hw.cores else 1.0  # every rank computing at once
    plans, elems, sync = [], [], 0.0
    for s in range(lay.pp):
        params = plan_cost.stage_parameters(m, lay, s)
        root = plan_cost.root_parameters(m, lay, s)
        block = (sum(r * c for r, c, _ in params) - root) / per
        gather = ag = rs = ar = 0.0
        if plan_cost.fsdp_on(lay):  # per group: the blocks and the root (embedding, final norm)
            times = 1 if lay.pp > 1 else 2  # a pipeline keeps its stage gathered
            # a forward gather follows a block's forward; in the backward a block's reduction and
            # the next gather follow its backward together; a pipeline reduces all at the end
            gf, gb = (cost[s][k] * slow / per for k in ("forward", "backward"))
            gb = gb / 2 if lay.pp == 1 else 0.0

            def fsdp(kind, size, calls, gap, axes=fsdp_axes):
                return plan_cost.collective(hw, lay, kind, size, axes, calls, gap=gap)
            ag = (fsdp("all_gather", block * pol.compute, per, gf) + fsdp("all_gather", root * pol.compute, times, gf)
                  + fsdp("all_gather", block * pol.compute, per * (times - 1), gb))
            rs = (fsdp("reduce_scatter", block * pol.reduce, per, gb)
                  + fsdp("reduce_scatter", root * pol.reduce, 1, gb))
            ar = (fsdp("all_reduce", block * pol.reduce / shard_n, per, 0.0, ("dp_replicate",))
                  + fsdp("all_reduce", root * pol.reduce / shard_n, 1, 0.0, ("dp_replicate",)))
            gather = ag / ((per + 1) * times)
        work, plan, after = cost[s], [], 0.0
        busy = mb * (work["forward"] + work["backward"])
        if plan_cost.fsdp_on(lay) and lay.pp > 1:  # gathered before the first forward, reduced after the last
            plan.append(("wait", gather if hw.streams else ag, "data_parallel"))  # backward: nothing
            after = rs + ar + (max(0.0, ag - gather - busy) if hw.streams else 0.0)  # hides them
        elif plan_cost.fsdp_on(lay) and hw.streams:  # beside this stage's compute, but the first gather
            after = max(0.0, mb * ag + rs + ar - busy) + gather
        sends = {up: plan_cost.collective(hw, lay, "send_recv", work["send"], ("pp",), ranks=2,
                                gap=work["forward" if up else "backward"] * slow) for up in (True, False)}
        for kind, i in order(lay.schedule, lay.pp, s, mb):
            up = kind == "F"
            if (s > 0 if up else s < lay.pp - 1):
                plan.append(("recv", (kind, s, i)))
            plan.append(("work", work["forward" if up else "backward"]))
            plan.append(("wait", work["forward_comm" if up else "backward_comm"], "tp_cp_ep_pp"))
            if lay.pp == 1 and plan_cost.fsdp_on(lay) and not hw.streams:  # each call blocks, in order
                plan.append(("wait", ag / 2 + (0.0 if up or i < mb - 1 else rs + ar), "data_parallel"))
            to = s + 1 if up else s - 1
            if 0 <= to < lay.pp:
                plan.append(("send", (kind, to, i), (kind, min(s, to)), sends[up]))
        plan.append(("wait", after, "data_parallel"))
        plans.append(plan)
        elems.append(sum(r * c for r, c, _ in params))
    end, parts = simulate(plans, lay.world // lay.pp, hw.cores)
    last = max(range(lay.pp), key=lambda s: end[s])
    out = {k: parts[last].get(k, 0.0) for k in ("compute", "bubble", "tp_cp_ep_pp", "data_parallel")}
    if lay.schedule == "Interleaved1F1B":  # two chunks a rank: the idle slots halve (simulated as 1F1B)
        out["bubble"] /= 2
    if lay.dp_replicate > 1 and not plan_cost.fsdp_on(lay):  # DDP
        speed = min(1.0, hw.cores / lay.world) if hw.cores else 1.0
        out["data_parallel"] += ddp_exposed(hw, lay, pol, cost[0]["backward"] / speed, elems[0] * pol.reduce)
    if lay.zero and lay.dp_replicate > 1:  # each replica updated its share: the weights gathered again
        out["data_parallel"] += plan_cost.collective(hw, lay, "all_gather", max(elems) * pol.compute, ("dp_replicate",))
    # after the schedule: the norms' gradients, partial sums over tp (each rank saw its part of
    # the sequence), summed one by one; the tied embedding's gradient summed over the first
    # and last stage; the gradient norm, the loss averaged (and sent across stages)
    if lay.tp > 1:
        sync += plan_cost.collective(hw, lay, "all_reduce", m.dim * pol.compute, ("tp",), 2 * per + 1)
    if lay.pp > 1 and m.tied:
        local = m.vocab // lay.tp * m.dim / (shard_n if plan_cost.fsdp_on(lay) else 1)
        sync += plan_cost.collective(hw, lay, "all_reduce", local * pol.reduce, ("pp",), ranks=2,
                           gap=cost[0]["backward"] * slow)
    sync += grad_norm(m, lay, pol, hw)
    sync += plan_cost.collective(hw, lay, "all_reduce", 8, ("dp_replicate", "dp_shard", "cp", "ep"))
    sync += plan_cost.collective(hw, lay, "all_reduce", 8, ("pp",))
    out["sync"] = sync
    local = plan_cost.memory(m, lay, pol, batch, seq)["parameters"] / pol.param
    speed = min(1.0, hw.cores / lay.world) if hw.cores else 1.0
    optimizer = local * (pol.param * 2 + pol.state * 4) / hw.bandwidth
    optimizer += 12 * hw.op_seconds * len(plan_cost.stage_parameters(m, lay, 0))
    out["optimizer"] = optimizer / speed
    out["total"] = sum(out.values())
    return out


def grad_norm(m: plan_cost.Model, lay: plan_cost.Layout, pol: plan_cost.Policy, hw: plan_cost.Hardware) -> float:
    """Seconds of the gradient norm's all-reduces (torch.nn.utils.get_total_norm, as train.py
    clips): one number a gradient tensor, over each mesh dimension that shards the gradients
    (FSDP's, TP's; DDP's are whole: none); the experts' own under EP, and one number over ep;
    one over pp."""
    kinds = [kind for _, _, kind in plan_cost.stage_parameters(m, lay, lay.pp - 1)]
    experts = kinds.count("expert") if lay.ep > 1 else 0
    shards = lay.dp_shard * lay.cp * lay.ep > 1 and plan_cost.fsdp_on(lay)
    out = plan_cost.collective(hw, lay, "all_reduce", (len(kinds) - experts) * pol.param, ("dp_shard", "cp", "ep"),
                     calls=int(shards))
    out += plan_cost.collective(hw, lay, "all_reduce", (len(kinds) - experts) * pol.param, ("tp",))
    if experts:
        out += plan_cost.collective(hw, lay, "all_reduce", experts * pol.param, ("dp_shard", "cp"),
                                    calls=int(plan_cost.fsdp_on(lay)))
        out += plan_cost.collective(hw, lay, "all_reduce", 8, ("ep",))
    return out + plan_cost.collective(hw, lay, "all_reduce", 8, ("pp",))


def flops(m: plan_cost.Model, batch: int, seq: int) -> float:
    """Model FLOPs of a step: 6 x matmul parameters per token plus attention (12 x layers x
    dim x seq per token; the causal half without a mask)."""
    h = m.ffn * (3 if m.gated else 2) * m.dim
    mlp = h * (m.top_k + m.shared) + m.dim * m.experts if m.experts else h
    per_layer = 2 * m.dim * m.dim + 2 * m.dim * m.kv_dim + mlp
    params = m.layers * per_layer + m.vocab * m.dim
    attn = 12 * m.layers * m.dim * seq * (1 if m.mask else 0.5)
    return batch * seq * (6 * params + attn)


def stage_memory(m: plan_cost.Model, lay: plan_cost.Layout, pol: plan_cost.Policy, batch: int, seq: int) -> list:
    """Memory of each stage's busiest rank, by component: its first rank holds the largest
    (ceil) shards."""
    per_stage = lay.world // lay.pp
    return [plan_cost.memory(m, lay, pol, batch, seq, stage * per_stage) for stage in range(lay.pp)]


def outputs(m: plan_cost.Model, lay: plan_cost.Layout, pol: plan_cost.Policy, batch: int, seq: int,
            stage: int) -> float:
    """Bytes of the outputs a pipeline's last stage keeps until the next step: every micro-batch's
    logits, in the compute dtype (1/tp of the vocabulary under loss_parallel). torch 2.14.1's
    PipelineStage.forward_one_chunk appends each ("if self.is_last and save_forward_output:
    self.output_chunks.append(output)", torch/distributed/pipelining/stage.py:999-1000, on by
    default: step(return_outputs=True)), the schedule merges them into step()'s return value
    (schedules.py:1006-1007) and the next step() clears them (schedules.py:984, stage.py:703)."""
    if lay.pp == 1 or stage != lay.pp - 1 or lay.engine != "torch":
        return 0
    vocab = m.vocab // lay.tp if lay.loss_parallel else m.vocab
    return batch // lay.data_parallel * seq // lay.cp * vocab * pol.compute


def at_peak(m: plan_cost.Model, lay: plan_cost.Layout, pol: plan_cost.Policy, batch: int, seq: int,
            rank: int = 0) -> dict:
    """The components of plan_cost.memory(...) alive at once at the rank's peak: the largest of
    the moments of the step below. Gradients are alive before the optimizer's step only when
    several micro-batches accumulate them (zero_grad sets them to None), and under FSDP in a
    pipeline not even then: each micro-batch's backward runs with set_requires_gradient_sync(False)
    (torch/distributed/pipelining/stage.py:936-939, backward_maybe_with_nosync), so they add up in
    the unsharded gradients (fsdp_unsharded) and the sharded ones appear only when
    perform_reduce_grad reduce-scatters after the last micro-batch (stage.py:1262-1275,
    schedules.py:1388). A pipeline's last stage holds its outputs (every micro-batch's logits) at
    each moment.
    - The loss's backward: the activations, the logits-sized gradients, the root's gathered
      weights (the blocks are resharded after their forward), DDP's buckets.
    - FSDP's last block's backward: the head's activations freed, the root's unsharded gradient
      (reduce-scattered when the whole backward ends), the block in use and the next one's
      all-gather, one logits-sized gradient.
    - A pipeline's step() returning: its outputs and their merge (torch.cat of output_chunks,
      schedules.py:1006-1007, microbatch.py:643), beside the weights, gradients and AdamW state.
    - The optimizer's step: weights, gradients, AdamW state, DDP's buckets."""
    mem = plan_cost.memory(m, lay, pol, batch, seq, rank)
    stage = plan_cost.coordinates(lay, rank)["pp"]
    rows = batch // lay.data_parallel // lay.passes
    fsdp = plan_cost.fsdp_on(lay)
    accumulated = lay.passes > 1 and not (fsdp and lay.pp > 1 and lay.engine == "torch")
    mem["outputs"] = outputs(m, lay, pol, batch, seq, stage)
    alive = {"parameters": mem["parameters"], "gradients": mem["gradients"] * accumulated,
             "optimizer": mem["optimizer"], "activations": mem["activations"], "outputs": mem["outputs"]}
    ddp = 0 if fsdp else mem["communication"]
    gathered = mem["fsdp_unsharded"]
    prefetch = fsdp and lay.pp == 1 and mem["communication"] > 0  # blocks resharded after forward
    root = plan_cost.root_parameters(m, lay, stage) * pol.compute if prefetch else gathered
    stored = {k: mem[k] for k in ("parameters", "gradients", "optimizer", "outputs")}
    moments = [dict(alive, fsdp_unsharded=root, communication=ddp, temporaries=mem["temporaries"]),
               stored | {"communication": ddp}]
    if lay.pp > 1:
        moments.append(stored | {"outputs": 2 * mem["outputs"]})
    if prefetch:
        head = plan_cost.head(m, lay, pol, rows, seq // lay.cp, stage)
        moments.append(dict(alive, activations=mem["activations"] - head,
                            fsdp_unsharded=gathered + root / pol.compute * pol.reduce,
                            communication=mem["communication"],
                            temporaries=mem["temporaries"] / plan_cost.loss_gradients(lay)))
    return max(moments, key=lambda parts: sum(parts.values()))


def stage_peaks(m: plan_cost.Model, lay: plan_cost.Layout, pol: plan_cost.Policy, batch: int, seq: int) -> list:
    """The simultaneous peak (at_peak) of each stage's busiest rank, as ``stage_memory``."""
    per_stage = lay.world // lay.pp
    return [at_peak(m, lay, pol, batch, seq, stage * per_stage) for stage in range(lay.pp)]


def peak_memory(m: plan_cost.Model, lay: plan_cost.Layout, pol: plan_cost.Policy, batch: int, seq: int) -> float:
    """What one GPU must hold: the largest of the stages' simultaneous peaks."""
    return max(sum(x.values()) for x in stage_peaks(m, lay, pol, batch, seq))


def predict(m: plan_cost.Model, lay: plan_cost.Layout, pol: plan_cost.Policy, hw: plan_cost.Hardware,
            batch: int, seq: int) -> dict:
    """The whole prediction: memory of each stage's busiest rank, the step and its parts,
    tokens/s a GPU and MFU against the data-sheet peak."""
    mems = stage_memory(m, lay, pol, batch, seq)
    s = step(m, lay, pol, hw, batch, seq)
    peak = hw.peak_float8 if pol.float8 and hw.peak_float8 else hw.peak
    tokens = batch * seq / s["total"] / lay.world
    alive = stage_peaks(m, lay, pol, batch, seq)
    return {"memory": mems, "at_peak": alive, "peak_memory": max(sum(x.values()) for x in alive), "step": s,
            "tokens_per_gpu": tokens, "mfu": flops(m, batch, seq) / s["total"] / lay.world / hw.peak,
            "peak_used": peak}


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr, exit status 2, nothing started or written
        sys.stderr.write(f"plan_step.py: {message}\n")
        raise SystemExit(2)


def main(argv=None):
    p = Parser(prog="plan_step.py", description=__doc__.splitlines()[0])
    p.add_argument("--hardware", metavar="FILE", help="predict with the hardware in FILE")
    for name, value in asdict(plan_cost.Model()).items():
        kind = (lambda s: s.lower() in ("1", "true", "yes")) if isinstance(value, bool) else int
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=value)
    for name, value in asdict(plan_cost.Layout()).items():
        kind = (lambda s: s.lower() in ("1", "true", "yes")) if isinstance(value, bool) else type(value)
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=value)
    p.add_argument("--bytes", type=int, default=4, help="bytes of every element (float32: 4)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    a = p.parse_args(argv)
    if not a.hardware or not os.path.isfile(a.hardware):
        p.error(f"--hardware {a.hardware or 'FILE'}: no such file "
                "(write one with plan_measure.py --measure and --sweep)")
    m = plan_cost.Model(**{k: getattr(a, k) for k in asdict(plan_cost.Model())})
    lay = plan_cost.Layout(**{k: getattr(a, k) for k in asdict(plan_cost.Layout())})
    for name in ("layers", "dim", "heads", "ffn", "vocab", "batch", "seq", "bytes", *plan_cost.AXES, "microbatches"):
        value = getattr(a, name)
        if value < 1:
            p.error(f"--{name.replace('_', '-')} {value}: must be at least 1")
    if (m.dim % m.heads or m.layers % lay.pp or m.heads % lay.tp or (m.kv_heads or m.heads) % lay.tp
            or a.seq % (lay.cp * lay.tp) or (lay.cp > 1 and a.seq % (2 * lay.cp))
            or a.batch % (lay.data_parallel * lay.passes)):
        p.error(f"the layout {lay.pp}x{lay.dp_replicate}x{lay.dp_shard}x{lay.cp}x{lay.ep}x{lay.tp} does not "
                "divide the model (heads and key-value heads by tp, layers by pp, the sequence by cp x tp and "
                "into 2 x cp chunks, the batch by the data-parallel ranks and micro-batches)")
    with open(a.hardware) as f:
        hw = plan_cost.Hardware(**json.load(f))
    pol = plan_cost.Policy(param=a.bytes, compute=a.bytes, reduce=a.bytes, state=a.bytes)
    out = predict(m, lay, pol, hw, a.batch, a.seq)
    print(json.dumps({"peak_memory": out["peak_memory"], "memory_rank0": out["memory"][0],
                      "step": out["step"], "tokens_per_gpu": out["tokens_per_gpu"], "mfu": out["mfu"]},
                     indent=1))


if __name__ == "__main__":
    sys.exit(main())
