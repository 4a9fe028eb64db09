"""`make bench`: run the benchmarks, merge their figures into docs/bench-results.json and regenerate
docs/BENCHMARKS.md (+ PNG plots). Every figure is a ratio against a baseline measured in the same
run, interleaved, median of rounds.

    python -m bench.run                    # default set (~15 min on 2 cores; progress alone ~5 min)
    python -m bench.run --only startup --startup-against REV   # also start-up ÷ commit REV's, same run
    python -m bench.run --only loop --data-against REV         # also loop + data path ÷ commit REV's (bench/against.py)
    python -m bench.run --only shards_scale --scale-against REV  # 100,000-shard open + pre-check, and REV's
    python -m bench.run --only loop amp    # some of them; the others keep their last recorded figures
    python -m bench.run --full             # also the time-to-accuracy run (tens of minutes)
    python -m bench.run --quick            # tiny sizes: checks the machinery, figures meaningless
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench import (
    against,
    amp,
    ckpt,
    datapath,
    ddp,
    elastic,
    exact,
    gpu224,
    links,
    live,
    live_nodes,
    loader224,
    loop,
    peers,
    progress,
    proposals,
    shards,
    shards_scale,
    soak,
    startup,
    stop_grace,
    straggler,
    tta,
    userscript,
)
from bench.common import REPO, Result, ensure_peers_venv, load_average, peers_python, set_threads
from torchlaunch.worker.precision import cpu_model

ALL = (
    "loop",
    "datapath",
    "loader224",
    "shards",
    "shards_scale",
    "gpu224",
    "amp",
    "ddp",
    "exact",
    "straggler",
    "ckpt",
    "elastic",
    "live",
    "live_nodes",
    "live_default",
    "links",
    "startup",
    "userscript",
    "stop_grace",
    "progress",
    "peers",
    "proposals",
    "soak",
    "tta",
    "tta_nobf16",
)
DOCS = REPO / "docs"
NO_CPU = "not recorded (measured before 2026-12-01)"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_selected(
    names: list[str],
    quick: bool,
    full: bool,
    work: Path,
    startup_against: str | None = None,
    data_against: str | None = None,
    scale_against: str | None = None,
) -> tuple[dict[str, dict], dict | None, dict]:
    results: dict[str, dict] = {}
    preempt: dict | None = None
    timings: dict[str, float] = {}
    peers_py = ensure_peers_venv(log) if "peers" in names else None

    def record(name: str, fn: Callable[[], object]) -> object:
        log(f"bench: {name} ... (load average {load_average()})")
        start = time.perf_counter()
        out = fn()
        timings[name] = time.perf_counter() - start
        log(f"bench: {name} done in {timings[name]:.0f} s")
        return out

    def keep(r: Result | list[Result] | None) -> None:
        for item in [r] if isinstance(r, Result) else (r or []):
            d = item.to_dict()
            d["measured_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            d["load_average"] = load_average()
            d["cpu"] = cpu_model()  # every figure names the CPU it was measured on: the box changes between sessions
            results[item.key] = d
            log(
                f"  {item.key}: {item.ratio:.3g} (goal {'>=' if item.higher_is_better else '<='} {item.goal}) "
                f"{'MET' if item.met else 'NOT MET'}"
            )

    if "loop" in names:
        keep(record("loop", lambda: loop.run(quick=quick)))
    if "datapath" in names:
        keep(record("datapath", lambda: datapath.run(quick=quick, work=work)))
    if "loader224" in names:
        keep(record("loader224", lambda: loader224.run(quick=quick, work=work)))
    if "shards" in names:
        keep(record("shards", lambda: shards.run(quick=quick, work=work)))
    if "shards_scale" in names:
        keep(record("shards_scale", lambda: shards_scale.run(quick=quick, work=work, against=scale_against)))
    if "gpu224" in names:  # without CUDA: one line saying it is skipped, no figure
        keep(record("gpu224", lambda: gpu224.run(quick=quick, work=work)))
    if "amp" in names:
        keep(record("amp", lambda: amp.run(quick=quick)))
    if "ddp" in names:
        keep(record("ddp", lambda: ddp.run(quick=quick)))
    if "exact" in names:
        keep(record("exact", lambda: exact.run(quick=quick)))
    if "straggler" in names:
        keep(record("straggler", lambda: straggler.results(quick=quick)))
    if "ckpt" in names:
        rs, preempt = record("ckpt", lambda: ckpt.run(quick=quick))
        keep(rs)
    if "elastic" in names:
        keep(record("elastic", lambda: elastic.run(quick=quick)))
    if "live" in names:
        keep(record("live", lambda: live.results(quick=quick)))
    if "live_nodes" in names:
        keep(record("live_nodes", lambda: live_nodes.results(quick=quick)))
    if "live_default" in names:
        keep(record("live_default", lambda: live_nodes.default_results(quick=quick)))
    if "links" in names:
        keep(record("links", lambda: links.results(quick=quick)))
    if "startup" in names:
        keep(record("startup", lambda: startup.run(quick=quick, work=work)))
        if startup_against and not quick:
            keep(record("startup-against", lambda: startup.against(startup_against, work=work / "against")))
    if "userscript" in names:
        keep(record("userscript", lambda: userscript.run(quick=quick)))
    if "stop_grace" in names:
        keep(record("stop_grace", lambda: stop_grace.run(quick=quick)))
    if "progress" in names:
        keep(record("progress-step", lambda: progress.run_steps(quick=quick)))
        keep(record("progress", lambda: progress.run(quick=quick)))
    if "peers" in names:
        keep(
            record(
                "peers",
                lambda: peers.run(peers_py, quick=quick, work=work, rounds=1 if quick else 8, reference_fp32=full),
            )
        )
        if full and not quick:  # the compute-bound extra: CIFAR-stem resnet18 on every side
            keep(record("peers-cifar", lambda: peers.run(peers_py, work=work, cifar_stem=True)))
    if "proposals" in names:
        keep(record("proposals", lambda: proposals.run(quick=quick)))
    if "soak" in names and full:  # 30 minutes and more: only with --full, as the time-to-accuracy runs
        keep(record("soak", lambda: soak.run(*soak.from_env(quick))))
    if data_against and not quick:
        keep(record("data-against", lambda: against.run(data_against, work=work / "data-against")))
    tta_result = None
    if "tta" in names and full:
        tta_result = record("tta", lambda: tta.run_full(work))
    no_bf16 = record("tta_nobf16", lambda: tta.run_no_bf16(work)) if "tta_nobf16" in names and full else None
    return results, preempt, {"timings_s": timings, "tta": tta_result, "tta_nobf16": no_bf16}


def fmt(v: float, unit: str) -> str:
    if unit == "s":
        return f"{v:.3g} s"
    return f"{v:,.0f} {unit}" if v >= 100 else f"{v:.3g} {unit}"


def no_bf16_lines(n: dict | None, bf16: dict | None) -> list[str]:
    """Issue 58's row: the same recipe on a CPU without bf16 (ISA capped), against the bf16 record."""
    lines = ["### The same recipe on a CPU without bf16", ""]
    if not n:
        return [*lines, f"Not recorded yet: run `{tta.NO_BF16_COMMAND}`.", ""]
    caps = " ".join(f"{k}={v}" for k, v in (n.get("isa_caps") or {}).items())
    ratio = f", {n['wall_s'] / bf16['wall_s']:.1f}x the bf16 record's {bf16['wall_s']:.0f} s" if bf16 else ""
    curve = " | ".join(f"{c['epoch']}: {100 * c['val_acc']:.2f}% @ {c['elapsed_s']:.0f} s" for c in n["curve"])
    return [
        *lines,
        f"- `{n['command']}`: `{caps}` hides bf16 from oneDNN and ATen (emulated, as on a CPU without bf16 "
        f"instructions), recorded {n['recorded_at']}, CPU {n['cpu']}, load average {n['load_average_before']} "
        f"before / {n['load_average_after']} after",
        f"- the recipe's `train.precision: auto` chose **{n['precision']}** ({n.get('precision_why')})",
        f"- wall time {n['wall_s']:.0f} s{ratio}; median {n['median_images_per_s']:.0f} images/s over 2 "
        f"processes; final validation top-1 **{100 * n['final_val_acc']:.2f}%**"
        + (f"; {n['cpu_s']:.0f} CPU seconds in its processes (what the load does not change)" if n.get("cpu_s") else "")
        + (f"; {n['conditions']}" if n.get("conditions") else ""),
        f"- per epoch: {curve}",
        "",
    ]


def render(doc: dict) -> str:
    res = doc["results"]
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python -m bench.run` (`make bench`); do not edit by hand. Every figure is a **ratio** "
        "against a baseline measured **in the same run, interleaved** (A, B, B, A, ...; for step benchmarks "
        "one step at a time), the median of the per-round ratios. The box these were measured on is shared "
        "(2 cores, other jobs running: the load average is given per figure), so absolute speeds are low "
        "and noisy; the ratios are what to compare.",
        "",
        f"Machine: {doc['machine']}. Torch threads per process in the in-process benchmarks: "
        f"{doc['threads']}. Last `make bench`: {doc.get('last_run', '?')}.",
        "",
        "| figure | project | baseline | ratio | goal | met | CPU | command |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res.values():
        op = ">=" if r["higher_is_better"] else "<="
        lines.append(
            f"| {r['title']} | {fmt(r['project'], r['unit'])} | {fmt(r['baseline'], r['unit'])} | "
            f"**{r['ratio']:.3g}** | {op} {r['goal']} | {'yes' if r['met'] else '**no**'} | "
            f"{r.get('cpu', NO_CPU)} | `{r['command']}` |"
        )
    pre = doc.get("preemption")
    if pre:
        lines.append(
            f"| Signal → checkpoint committed ({pre['model']}, 2 CPU ranks, real torchrun) | "
            f"{pre['signal_to_commit_s']:.2f} s | – | – | <= 5 s | "
            f"{'yes' if pre['signal_to_commit_s'] <= 5 else '**no**'} | {pre.get('cpu', NO_CPU)} | "
            f"`python -m bench.run --only ckpt` |"
        )
        lines.append(
            f"| Steps lost across preemption + rerun | {pre['steps_lost']} | – | – | 0 | "
            f"{'yes' if pre['steps_lost'] == 0 and pre['continuous'] else '**no**'} | "
            f"{pre.get('cpu', NO_CPU)} | `python -m bench.run --only ckpt` |"
        )
    lines += ["", "![measured ÷ goal](bench-ratios.png)", "", "## Details", ""]
    for r in res.values():
        lines += [
            f"### {r['title']}",
            "",
            f"- project: {r['project_label']} — {fmt(r['project'], r['unit'])}",
            f"- baseline: {r['baseline_label']} — {fmt(r['baseline'], r['unit'])}",
            f"- ratio {r['ratio']:.3g} (per round: {', '.join(f'{x:.3g}' for x in r['rounds'])}); goal "
            f"{'>=' if r['higher_is_better'] else '<='} {r['goal']}",
            f"- {r['notes']}",
            f"- measured {r['measured_at']}, CPU {r.get('cpu', NO_CPU)}, load average {r['load_average']}; "
            f"reproduce: `{r['command']}`",
            "",
        ]
    if pre:
        lines += [
            "### Preemption: signal → committed checkpoint, and steps lost",
            "",
            f"`python -m launch.local --gpus 2 --device cpu` trains {pre['model']} (synthetic data, "
            f"{pre['max_steps']} steps); SIGTERM goes to the launcher after rank 0 logs step 2. The worker "
            f'reported "checkpoint committed at global step {pre["committed_step"]} ... '
            f'{pre["signal_to_commit_s"]:.2f} s after the signal" and the launcher exited 75. The same '
            f"command run again resumed at global step {pre['resumed_at_step']} (last step logged before the "
            f"exit: {pre['last_step_logged_before_exit']}) and exited {pre['rerun_exit']}; metrics.jsonl holds "
            f"steps {pre['steps_logged']} — {'each exactly once, no gap' if pre['continuous'] else 'NOT continuous'}. "
            f"Bitwise equality with an uninterrupted run is asserted by the test suite "
            f"(tests/integration/test_resume.py), not here.",
            "",
        ]
    t = doc.get("tta")
    lines += ["## Time to accuracy: configs/fast.yaml, 2 CPU processes", ""]
    if t:
        cpu = t.get("cpu") or "not recorded (2026-11-30: a CPU with fast bf16, the recipe's then-fixed precision)"
        chosen = f"{t['precision']} ({t.get('precision_why')})" if t.get("precision") else "bf16, fixed then"
        curve = " | ".join(
            f"{c['epoch']}: {100 * c['val_acc']:.2f}%{' (TTA)' if c.get('tta') else ''} @ {c['elapsed_s']:.0f} s"
            for c in t["curve"]
        )
        lines += [
            f"- command: `{t['argv']}` (via `{t['command']}`), recorded {t['recorded_at']}, load average "
            f"{t['load_average_before']} before / {t['load_average_after']} after",
            f"- CPU {cpu}; precision {chosen}",
            f"- wall time {t['wall_s']:.0f} s (process start to exit), median {t['median_images_per_s']:.0f} "
            f"images/s over 2 processes; final validation top-1 **{100 * t['final_val_acc']:.2f}%** on the "
            f"seeded 5,000-image split",
            f"- goal >= {100 * t['goal']:.0f}%: "
            + (f"reached after {t['time_to_goal_s']:.0f} s" if t["time_to_goal_s"] else "**not reached**"),
            f"- per epoch (validation top-1 @ seconds since training start): {curve}",
            "- reference from the issue: airbench94 rebuilt for CPU, ~90% (91% with test-time augmentation) "
            "after ~1,000 s on this box (quiet), ~510 images/s",
            '- the recipe: the airbench ideas as project switches (docs/recipes.md, "The time-to-accuracy recipe"); '
            "epochs validate without test-time augmentation, the final one with it (flip + 1-pixel "
            "translations, 6 views)",
            "- how accuracy scales with time here (single runs, before the 128-image micro-batches and the "
            "shared-memory gradients, ~52 s per epoch when quiet): 10 epochs 90.22% (TTA; 734 s on a loaded "
            "box), 16 epochs 90.92% after 847 s, 40 epochs 91.34% after 2,149 s (`train.epochs=40 "
            "optim.warmup_epochs=9.2`, box mostly quiet); the previous recipe (no whitening, lookahead or TTA) "
            "86.88% after 1,566 s (loaded box). `train.micro_batch_size=128` then took the same 16 epochs "
            "from 877 to ~980 images/s (128 images per pass is the fastest size on this CPU; BatchNorm "
            "statistics per 128 images did not cost accuracy) and to this record. Returns shrink "
            "fast: +0.7 points for 1.6x the time, then +0.4 for 2.5x more. 93% on this JPEG copy "
            "(quality 75; airbench94 reaches 94% on the original images, ~91% here) is out of reach "
            "for this net at any affordable length; a wider, deeper net (airbench95/96-style, several "
            "times the compute per epoch) is the way there, hours on 2 CPU cores",
            "",
            "![accuracy vs time](bench-tta.png)",
            "",
        ]
    else:
        lines += ["Not recorded yet: run `python -m bench.run --full --only tta`.", ""]
    lines += no_bf16_lines(doc.get("tta_nobf16"), t)
    dp, fused, xxh3 = res.get("datapath"), res.get("proposal_fused_sgd"), res.get("adopted_xxh3")
    pl = res.get("peers_lightning") if "project-1x2" in res.get("peers_lightning", {}).get("extra", {}) else None
    lines += ["## Fast paths adopted in train/ after measuring them here", ""]
    if dp and dp.get("extra", {}).get("proposed_gain"):
        lines.append(
            f"- data path (`torchlaunch.worker.data.augment`, `TrainLoader`): the batch is gathered with `index_select` "
            f"and cropped + flipped with ONE gather over the flattened padded images instead of 4-D "
            f"advanced indexing (bit-identical output, asserted): "
            f"{dp['extra']['proposed_images_per_s']:,.0f} images/s in the side-by-side check."
        )
    if fused:
        lines.append(
            f"- optimizer (`torchlaunch.worker.optim.build_optimizer`): `SGD(..., fused=True)` on CPU too: the step is "
            f"**{fused['ratio']:.2f}x** faster than `foreach=True` ({fused['notes']})."
        )
    if xxh3:
        lines.append(
            f"- checkpoint integrity (`torchlaunch.core.checkpoint`): sha256 was the main cost of save and load; the "
            f"adopted xxh3-128 (the `xxhash` package) verifies **{xxh3['ratio']:.1f}x** faster per pass "
            f"(corruption detection; safety against crafted files comes from weights_only=True)."
        )
    lines += [
        "- evaluation (`torchlaunch.worker.eval_loop`): runs the unwrapped model with rank 0's buffers, not "
        "the DDP wrapper, whose forward is a collective: with 1 validation image on 2 ranks the ranks used to "
        "hang until the gloo timeout.",
        "- gradients on gloo with more than two ranks are averaged by a rank-ordered sum (bit-exact resume); "
        "with two ranks plain all-reduce is already exact and is kept (no cost).",
        "",
    ]
    lines += [
        "## GPU",
        "",
        "`bench/gpu.py` measures, in one short call on one GPU: training images/s per GPU (fastnet, fastnet93 "
        "and resnet18, bf16 + channels_last, with and without torch.compile), data-path images/s with the uint8 "
        "set resident on the GPU, and (with `--data-root`) the time for configs/fast.yaml to reach a goal "
        "accuracy. **Measured once, 2026-12-04**, on one NVIDIA H200 (driver 580.159.04), torch 2.11.0+cu130 "
        "(the machine's own; the project pins 2.14.1), the tree of commit f6ec2c9, by `bash bench/gpu_check.sh` "
        "(`python -m bench.gpu --no-compile --steps 30`): eager training step fastnet **215,330** images/s, "
        "fastnet93 **93,056**, resnet18 (batch 512) **44,958**; the data path alone **2,319,147** images/s. "
        "Not measured: the torch.compile variants and the time-to-accuracy run (the shared JPEG copy tops out "
        "near 91%, below its 94% goal; fast.yaml's 91.18% in 5.4 s of training is in the table below). "
        "docs/bench-gpu-airbench.json and docs/GPU.md hold the raw figures.",
        "",
        "### airbench peers",
        "",
        "Same call (`python -m bench.gpu --peer-airbench`, PyPI airbench 0.1.8): every run trains on the same "
        "45,000 images of the shared CIFAR-10 JPEG copy (the project's seeded 90% split) and is scored on the "
        "held-out 5,000 (its validation split; no separate test images were carried). One run each, cold.",
        "",
        "| run | test top-1 | training s | images/s | command s |",
        "|---|---|---|---|---|",
        "| fast.yaml | 91.18% | 5.4 | 158,243 | 11.4 |",
        "| airbench94 | 90.08% | 2.3 | 188,580 | 20.8 |",
        "| fast93.yaml | 92.46% | 22.7 | 88,336 | 30.2 |",
        "| airbench96 | 92.58% | 17.7 | 99,342 | 32.3 |",
        "",
        "Issue 15's goal for fast93.yaml, >= 93.0% in <= 20 s of training on one H200: **not met** on either "
        "count (92.46%, 0.54 points short; 22.7 s, 2.7 s over; the project's seconds include every epoch's "
        "validation and checkpoint save, airbench's do not). airbench96 on the same images: 92.58% in 17.7 s, "
        "also below 93% on this JPEG copy (issue 15 quotes 93.27% for it). fast.yaml beats airbench94's "
        "accuracy (91.18% vs 90.08%) in 2.3x its training time. Not run: `fast93.yaml train.epochs=32`.",
        "",
        "`bench/gpu224.py` (`python -m bench.run --only gpu224`) measures issue 27's two GPU rows: batched "
        "`decode_jpeg(device=cuda)` images/s ÷ torchvision's A100 figure (7,800), and ResNet-50 AMP at 224 px "
        "on a shard set with `data.decode=gpu` ÷ the same Trainer on synthetic in-GPU data (goal >= 0.9 and "
        ">= 2,500 images/s). Both rows in the table above were measured in the same call (2026-12-04, one "
        "H200, torch 2.11.0+cu130, through `python -m bench.gpu_check gpu224`): the decode goal is met, the "
        "end-to-end goal is not. data.decode=cpu (8 workers) ran at the same rate as data.decode=gpu, and the "
        "decode plus crop alone ran at 5,634 images/s, so the JPEG decode is not what holds the shard path back; "
        "what does was not found in this one call.",
        "",
        "## Honest notes",
        "",
        "- The torchvision reference classification `train.py` is not shipped in any package and cannot be "
        "fetched here; `bench/peer_reference.py` is our own minimal equivalent of its CPU code path "
        "(ImageFolder + PIL transforms + DataLoader + SGD momentum 0.9, wd 1e-4, one process, fp32 as the "
        "reference runs on CPU; a bf16 + channels_last variant is also tried and the better one is used). "
        "It does the work the script does and where: per step top-1/top-5 of the step's output and its "
        "metric updates (`.item()`s, a log line every 10 steps), per epoch the StepLR step, evaluation of "
        "the val folder and, with an output folder, the checkpoint written as model_0.pth and "
        "checkpoint.pth. Every side validates the same held-out images each epoch, as the project does.",
        "- Async save: the stall is the snapshot copy (~90 MB of resnet18 model + optimizer state into "
        "freshly allocated memory). It measured 0.093-0.098 of a synchronous save early on 2026-11-30 "
        "and 0.17-0.28 after 15:40 UTC; the code this session started from measured 0.209 in the same "
        "minute, so the host's page-fault cost moved, not the code. Reusing the previous snapshot's "
        "buffers (no fresh pages per save) is the known next step.",
        "- Lightning runs in a separate benchmark venv (`bench/.venv-peers`, created by `bench.run`, layered "
        "on the project's torch through a .pth file); it is never a project dependency.",
        "- The 2-rank DDP figure needs 2 idle cores; on a shared 2-core box it measures the load as much as "
        "DDP (see its load average). With no change to any DDP path it measured 1.92 at 12:33 UTC on "
        "2026-11-30 and 1.84 and 1.78 in two runs after 14:45 that day (the AMP figure 2.01, 1.97, 1.99 "
        "alongside): the 1.9 goal is met on a quiet host only. It fell from 2.13 to 1.84-1.88 when fastnet's whitening stem and "
        "BatchNorm scales were frozen: the 1-rank baseline got ~11% faster (434 -> 483 images/s: less "
        "backward work) while 2 ranks stayed at ~905 images/s; DDP's static_graph and a single 100 MB "
        "bucket did not help (1.80, 1.89). What the 2 ranks lose, measured rank by rank: gloo's TCP "
        "all-reduce ~10 ms per step (the whole gap to a run with no gradient sync, 1.93-1.96x, was ~4%) and "
        "ranks wandering between the two cores. Pinning each rank to a core and averaging gradients "
        "through shared memory (copy + sum ~1.2 ms per step; the rest of the hook's time is waiting for the "
        "slower rank) brought 2 ranks back up (adopted figure above); timed steps went from 8 to 16 per "
        "round to steady the figure. On the stock resnet18 (47 MB of gradients per step) the same paths "
        "took 2 ranks from ~820-900 to ~930-1,020 images/s (per-rank batch 64, bench/ddp_worker.py, same "
        "session), and the peers' project-2x1 layout end to end from 405 to 520 images/s. (A first "
        "version sized the slots to DDP's 25 MB cap; DDP closes a bucket only after passing the cap, so "
        "resnet18's middle bucket fell back to a synchronous gloo gather and ran 20% slower than gloo: "
        "slots now hold the cap plus the largest parameter.) Larger per-rank batches scale worse here (512 per rank: 1.81-1.83x, "
        "memory-bandwidth bound), smaller ones too (64: 1.86x; 32: 1.73x).",
        "- Peers: on the stock resnet18 (little compute per image) one process with 2 threads beats two "
        "DDP processes for both the project and Lightning, so the best-vs-best ratio is what is reported; "
        "against Lightning in the DDP layout the issue measured, the project is "
        + (f"{pl['extra']['project-1x2'] / pl['extra']['lightning-ddp2x1']:.2f}x" if pl else "n/a")
        + ". Until 2026-11-30 the project's 1 x 2 layout and the reference loop inherited bench.run's own "
        "OMP_NUM_THREADS=1 and ran on one thread (the figures of earlier runs, ~1.0x, were that); every "
        "side now picks its own threads (bench/peers.py side_env, tested). The project's run of ~6.4 s "
        "is ~2.4 s of start-up (importing torch ~1.1 s and torch._dynamo ~1.3 s, which torch.optim "
        "imports on the first optimizer and torchvision on import, so every side pays it; the cold JPEG "
        "decode runs in a child process meanwhile), ~3.5 s of training at ~1,450 images/s (the speed of a "
        "bare loop over tensors already in memory, bench/loop.py) and ~0.3 s for validation and the two "
        "durable saves (model.pt is written while the final checkpoint commits). The reference-style "
        "loop trains at ~0.7x of that bare loop (its 2 DataLoader workers decode and augment on the same "
        "2 cores) and pays the same start-up, so the end-to-end ratio sits near 1.3x and moves with the "
        "box's load. Measurement: one survey round of all six layouts picks each family's best, then "
        "the three best run in adjacent rounds (R P L, L P R, ...); before 2026-11-30 all six ran every "
        "round, a compared pair was up to a minute apart, and the same code gave 1.33, 1.42, 1.16, 1.26 "
        "and 1.20 in five runs within an hour (per-round ratios 1.09-1.47). 12 adjacent pairs of just "
        "project-1x2 and reference-bf16 (ABBA, same hour): median 1.32, best time ÷ best time 1.37. "
        "The adjacent harness's first four runs: 1.31 (per-round 1.21-1.58), 1.25 (1.11-1.41), 1.32 "
        "(1.21-1.37) and 1.27 (1.10-1.70): the "
        "1.3x goal is met at the median of all these, not with a margin the box's noise respects. "
        "Until 2026-11-30 the peers also skipped the per-epoch validation the project does, and the "
        "reference loop the per-step metrics and second checkpoint file its script writes; adding them "
        "cost the reference loop +1.8% of its wall time (8.40 -> 8.55 s, mean of 3 interleaved runs "
        "each).",
        "",
    ]
    if doc.get("timings_s"):
        total = sum(doc["timings_s"].values())
        lines += [
            "Last run's duration per benchmark: "
            + ", ".join(f"{k} {v:.0f} s" for k, v in doc["timings_s"].items())
            + f" (total {total:.0f} s).",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=ALL, help="run only these benchmarks")
    p.add_argument("--full", action="store_true", help="also the time-to-accuracy run (tens of minutes)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for checking the machinery")
    p.add_argument("--render", action="store_true", help="run nothing: regenerate the docs from the stored figures")
    p.add_argument("--threads", type=int, default=1, help="torch threads in the in-process benchmarks")
    p.add_argument("--docs", type=Path, default=DOCS, help="where BENCHMARKS.md and the plots go")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (data unpacked here)")
    p.add_argument(
        "--startup-against",
        metavar="REV",
        default=None,
        help="with startup: also this tree's start-up ÷ commit REV's, measured in the same run",
    )
    p.add_argument(
        "--scale-against",
        metavar="REV",
        help="with shards_scale: also time commit REV's open and pre-check of the 100,000-shard set (one round)",
    )
    p.add_argument(
        "--data-against",
        metavar="REV",
        help="also run bench.loop and bench.datapath from commit REV and this tree, alternating (bench/against.py)",
    )
    args = p.parse_args(argv)
    names = [] if args.render else list(args.only or ALL)
    set_threads(args.threads)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-"))
    start = time.perf_counter()
    results, preempt, more = run_selected(
        names, args.quick, args.full, work, args.startup_against, args.data_against, args.scale_against
    )
    args.docs.mkdir(parents=True, exist_ok=True)
    store = args.docs / "bench-results.json"
    doc = json.loads(store.read_text()) if store.is_file() else {"results": {}}
    doc["results"].update(results)
    order = [
        "loop",
        "datapath",
        "loader224",
        "first_batch",
        "shards_decode",
        "shards_open",
        "shards_scale_open",
        "shards_scale_precheck",
        "shards_writer",
        "gpu_decode",
        "gpu_e2e",
        "amp",
        "ddp",
        "exact-smoke",
        "exact-resnet18",
        "straggler",
        "ckpt_save",
        "ckpt_load",
        "ckpt_async",
        "ckpt_resume",
        "elastic-recovery",
        "elastic-throughput",
        "live-recovery",
        "live-frozen",
        "live-rejoin",
        "live-steady",
        "live-vs-torchft",
        "live-nodes",
        "live-nodes-frozen",
        "live-node-replaced",
        "startup",
        "startup_against",
        "loop_against",
        "datapath_against",
        "userscript",
        "progress_step",
        "progress",
        "peers_lightning",
        "peers_reference",
        "peers_lightning_cifar",
        "peers_reference_cifar",
        "proposal_fused_sgd",
        "adopted_xxh3",
        "adopted_cpu_ddp",
    ]
    order += sorted(k for k in doc["results"] if k not in order)  # a new figure is listed, never dropped
    doc["results"] = {k: doc["results"][k] for k in order if k in doc["results"]}
    if preempt:
        doc["preemption"] = {**preempt, "cpu": cpu_model()}
    doc["tta"] = more["tta"] or tta.recorded(args.docs / "bench-tta.json") or doc.get("tta")
    doc["tta_nobf16"] = more["tta_nobf16"] or tta.recorded(args.docs / tta.NO_BF16_RECORD.name) or doc.get("tta_nobf16")
    doc["machine"] = (
        f"{cpu_model()}, {platform.machine()} Linux, {len(__import__('os').sched_getaffinity(0))} cores, torch "
        f"{torch.__version__}, Python {platform.python_version()}"
    )
    doc["threads"] = args.threads
    if names:
        doc["last_run"] = f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, benchmarks: {' '.join(names)}"
    if names:
        doc["timings_s"] = more["timings_s"]
    store.write_text(json.dumps(doc, indent=1) + "\n")
    (args.docs / "BENCHMARKS.md").write_text(render(doc))
    plot_python = sys.executable if importlib.util.find_spec("matplotlib") else peers_python()
    if Path(plot_python).is_file():  # the peers venv has matplotlib; never created just for plots
        subprocess.run([str(plot_python), "-m", "bench.plots", str(store), str(args.docs)], cwd=REPO, check=False)
    log(f"bench: wrote {args.docs / 'BENCHMARKS.md'} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
