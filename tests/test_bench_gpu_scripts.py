"""bench/gpu/: the GPU scripts take their output directory and choices as arguments and environment, name no
machine's paths, print their header as usage, and build command lines the benchmark accepts (DRY=1 prints
the commands instead of running them, so this runs on any machine)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from bench.probes.cold_read import build_parser as cold_read_parser
from bench.probes.cold_read import variants
from bench.run import build_parser, configs

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "bench" / "gpu"
SCRIPTS = sorted(p.name for p in GPU.glob("*.sh") if p.name != "lib.sh")


def _dry(script: str, *args: str, **env: str) -> list[list[str]]:
    """The commands ``script`` would run (its ``=== name: command`` lines)."""
    done = subprocess.run(["bash", str(GPU / script), *args], env={**os.environ, "DRY": "1", "PYTHON": "python", **env},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [shlex.split(line.split(": ", 1)[1]) for line in done.stdout.splitlines()
            if line.startswith("=== ") and ": " in line and "skipped" not in line]


def test_the_dated_scripts_are_gone() -> None:
    assert SCRIPTS == ["checks.sh", "cold_path.sh", "fleets.sh", "fleets_i31.sh", "issue30.sh", "issue30_reads.sh",
                       "issue30_small.sh", "issue42.sh", "issue43.sh", "issue44_push.sh", "parallel.sh", "serve.sh",
                       "suite.sh"]
    assert not list((ROOT / "bench").glob("gpu_*.sh"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_is_executable_bash_and_prints_its_header_as_usage(script: str) -> None:
    path = GPU / script
    assert os.access(path, os.X_OK)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True, timeout=10).returncode == 0
    usage = subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=10)
    assert usage.returncode == 2 and f"bash bench/gpu/{script} OUT" in usage.stderr


@pytest.mark.parametrize("script", [*SCRIPTS, "lib.sh"])
def test_script_names_no_machine_path(script: str) -> None:
    text = (GPU / script).read_text().replace("${TMPDIR:-/tmp}", "$TMPDIR")
    found = re.findall(r"(?:/tmp|/work|/home|/root|/mnt|\.\./shared|\.device)\b[^\s\"']*", text)
    assert not found, f"{script} names machine paths {found}: take them from arguments or the environment"


def test_suite_runs_each_scenario_at_each_lead_with_options_bench_run_accepts(tmp_path: Path) -> None:
    commands = _dry("suite.sh", str(tmp_path), "seed", "zipf", LEADS="0.05 0", CHECK_SIM="1", REQUESTS="120",
                    TAG="fleet2", EXTRA="--replicas 2 --arrivals poisson:8", ADAPTERS=str(tmp_path / "ad"))
    assert [c[:3] for c in commands] == [["python", "-m", "bench.run"]] * 4
    outs = []
    for command in commands:
        bench, spec = configs(build_parser().parse_args(command[3:]))
        assert bench.engine == "real" and bench.check_sim and bench.replicas == 2 and spec.requests == 120
        assert bench.adapters == str(tmp_path / "ad") and spec.arrivals == "poisson:8"
        outs.append((bench.scenario, bench.hint_lead_s, Path(bench.out).relative_to(tmp_path).as_posix()))
    assert outs == [("seed", 0.05, "fleet2-seed-lead0.05"), ("seed", 0.0, "fleet2-seed-lead0"),
                    ("zipf", 0.05, "fleet2-zipf-lead0.05"), ("zipf", 0.0, "fleet2-zipf-lead0")]


def test_fleets_runs_each_fleet_and_scenario_per_router_and_global_at_each_lead(tmp_path: Path) -> None:
    """Issue 31, item 3: 2 x TP 2 and 4 x TP 1; queue + affinity, overlap and the oracle + least-loaded once,
    global + Route at each lead, every run with --check-sim; a trace replay when given one."""
    trace = tmp_path / "trace.jsonl"
    commands = _dry("fleets.sh", str(tmp_path), "zipf", "trace", TRACE=str(trace), ADAPTERS=str(tmp_path / "ad"))
    runs = []
    for command in commands:
        assert command[:3] == ["python", "-m", "bench.run"]
        bench, spec = configs(build_parser().parse_args(command[3:]))
        assert bench.engine == "real" and bench.check_sim and spec.requests == 40
        assert bench.replicas * bench.tp == 4 and bench.adapters == str(tmp_path / "ad")
        runs.append((Path(bench.out).relative_to(tmp_path).as_posix(), bench.router, bench.policies,
                     bench.hint_lead_s, spec.arrivals))
    for fleet, rate in (("2x2", "poisson:8"), ("4x1", "poisson:16")):
        assert [r for r in runs if r[0].startswith(f"{fleet}-zipf")] == [
            (f"{fleet}-zipf-affinity", "affinity", "queue", 0.0, rate),
            (f"{fleet}-zipf-least-loaded", "least-loaded", "overlap,oracle", 0.0, rate),
            (f"{fleet}-zipf-lora-cache-lead0.05", "lora-cache", "global", 0.05, rate),
            (f"{fleet}-zipf-lora-cache-lead0", "lora-cache", "global", 0.0, rate)]
        assert [r[4] for r in runs if r[0].startswith(f"{fleet}-trace")] == ["trace"] * 4
    assert not [c for c in _dry("fleets.sh", str(tmp_path), "trace") if "bench.run" in c]  # no TRACE: skipped


def test_fleets_i31_runs_what_item_3_lacks_in_order_within_its_budget(tmp_path: Path) -> None:
    """Issue 31, item 3's remainder in one call: 4 x TP 1 at both leads with its baselines, 2 x TP 2 at lead 0,
    then the 2 x TP 2 baselines again; each with --check-sim; the budget skips runs rather than overrun."""
    commands = _dry("fleets_i31.sh", str(tmp_path), ADAPTERS=str(tmp_path / "ad"), BUDGET="700")
    runs = []
    for command in commands:
        assert command[:5] == ["timeout", "-k", "15", "240", "python"] and command[5:7] == ["-m", "bench.run"]
        bench, spec = configs(build_parser().parse_args(command[7:]))
        assert bench.engine == "real" and bench.check_sim and spec.requests == 60
        assert bench.replicas * bench.tp == 4 and bench.adapters == str(tmp_path / "ad")
        runs.append((Path(bench.out).relative_to(tmp_path).as_posix(), bench.router, bench.policies,
                     bench.hint_lead_s, spec.arrivals))
    assert runs == [
        ("4x1-zipf-affinity", "affinity", "queue", 0.0, "poisson:16"),
        ("4x1-zipf-lora-cache-lead0.05", "lora-cache", "global", 0.05, "poisson:16"),
        ("4x1-zipf-least-loaded", "least-loaded", "overlap,oracle", 0.0, "poisson:16"),
        ("4x1-zipf-lora-cache-lead0", "lora-cache", "global", 0.0, "poisson:16"),
        ("2x2-zipf-lora-cache-lead0", "lora-cache", "global", 0.0, "poisson:8"),
        ("2x2-zipf-affinity", "affinity", "queue", 0.0, "poisson:8"),
        ("2x2-zipf-least-loaded", "least-loaded", "overlap,oracle", 0.0, "poisson:8")]
    default = _dry("fleets_i31.sh", str(tmp_path))  # 500 s at 75 s a policy: the 2x2 baselines left out
    assert [Path(c[-1]).name for c in default] == [r[0] for r in runs[:5]]
    short = _dry("fleets_i31.sh", str(tmp_path), BUDGET="160", EST="75")  # two runs of one policy fit
    assert [Path(c[-1]).name for c in short] == ["4x1-zipf-affinity", "4x1-zipf-lora-cache-lead0.05"]


def test_serve_runs_the_serve_app_on_the_gpus_under_both_routings_within_its_budget(tmp_path: Path) -> None:
    """Issue 32, item 1: the probe's preflight, the adapters written in a step of their own (before the timed runs),
    both routings (serve first), then both again in the other order while the budget allows; each a probe command
    line the probe accepts, its rows in OUT."""
    from bench.probes.ray_serve import build_parser as serve_parser

    def probes(**env: str) -> list[list[str]]:
        return [c for c in _dry("serve.sh", str(tmp_path), **env) if "bench.probes.ray_serve" in c]

    commands = probes(ADAPTERS=str(tmp_path / "ad"))
    runs = []
    for command in commands:
        at = command.index("bench.probes.ray_serve")
        args = serve_parser().parse_args(command[at + 1 :])
        assert (args.device, args.model, args.adapter_ranks, args.replicas, args.slots, args.adapters) == (
            "cuda", "llama-3.1-8b", "16,64", 4, 4, 64)
        assert args.adapter_dir == str(tmp_path / "ad") and args.requests == 300 and args.fresh_state
        runs.append((args.preflight, args.write_adapters, args.routings, args.seed,
                     args.json and Path(args.json).relative_to(tmp_path)))
    assert runs == [(True, False, "serve,lora-cache", 0, None), (False, True, "serve,lora-cache", 0, None),
                    (False, False, "serve,lora-cache", 0, Path("serve.json")),
                    (False, False, "lora-cache,serve", 1, Path("serve-again.json"))]
    assert all(c[:3] == ["timeout", "-k", "15"] for c in commands[1:])
    assert len(probes(BUDGET="100", EST="150")) == 3  # no time left for a second pass
    cpu = probes(DEVICE="cpu")[2]
    args = serve_parser().parse_args(cpu[cpu.index("bench.probes.ray_serve") + 1 :])
    assert (args.device, args.model, args.adapter_ranks, args.replicas) == ("cpu", "tiny", "8,16", 3)


def test_checks_runs_the_parts_asked_and_skips_tp_without_the_gpus(tmp_path: Path) -> None:
    commands = _dry("checks.sh", str(tmp_path), "kernels", "tp", "engine", DRY_GPUS="1", MODEL="tiny")
    modules = [c[2] for c in commands]
    assert modules == ["bench.probes.kernels", "workers.engine", "workers.engine"]  # no TP 2 on one GPU
    assert all("tiny" in c for c in commands)
    assert [c[2] for c in _dry("checks.sh", str(tmp_path), "tp", DRY_GPUS="2")] == ["bench.probes.tp_ready"]


def test_checks_push_part_runs_the_push_probe_at_both_shapes_with_options_it_accepts(tmp_path: Path) -> None:
    from bench.probes.push import build_parser as push_parser

    commands = _dry("checks.sh", str(tmp_path), "push", DRY_GPUS="2")
    assert [c[2] for c in commands] == ["bench.probes.push", "bench.probes.push"]
    parsed = [push_parser().parse_args(c[3:]) for c in commands]
    assert [(a.tp, a.model, a.rank) for a in parsed] == [(2, "llama-3.1-8b", 16), (2, "llama-3.1-70b", 64)]
    assert _dry("checks.sh", str(tmp_path), "push", DRY_GPUS="1") == []  # no TP 2 on one GPU


def test_issue30_reads_runs_each_shape_with_its_phases_then_the_tests_and_the_summary(tmp_path: Path) -> None:
    commands = _dry("issue30_reads.sh", str(tmp_path), ADAPTERS=str(tmp_path / "ad"))
    assert commands[0][:2] == ["bash", "-c"]
    probes = [cold_read_parser().parse_args(c[3:]) for c in commands if c[2:3] == ["bench.probes.cold_read"]]
    assert [(p.model, p.rank, p.tp, Path(p.out).name if p.out else p.summary) for p in probes] == [
        ("llama-3.1-8b", 16, 4, "cold-8b-r16.json"), ("llama-3.1-8b", 64, 4, "cold-8b-r64.json"),
        ("llama-3.1-70b", 64, 4, "cold-70b-r64.json"), ("llama-3.1-8b", 64, 4, "arena-pin.json"),
        ("llama-3.1-8b", 64, 4, str(tmp_path))]
    assert probes[3].arena_pin == 16
    assert all({"process", "thread"} <= {v[0] for v in variants(p.variants)} for p in probes[:3])
    assert any(c[:5] == ["timeout", "120", "python", "-m", "pytest"] for c in commands)


def test_issue30_small_runs_tp1_probes_the_before_tree_and_the_summary_into_one_tar(tmp_path: Path) -> None:
    before = tmp_path / "before"
    before.mkdir()
    commands = _dry("issue30_small.sh", str(tmp_path), ADAPTERS=str(tmp_path / "ad"), BEFORE=str(before))
    assert commands[0][:2] == ["bash", "-c"]
    probes = [cold_read_parser().parse_args(c[c.index("bench.probes.cold_read") + 1 :]) for c in commands
              if "bench.probes.cold_read" in c]
    assert [(p.model, p.rank, p.tp, Path(p.out).name if p.out else Path(p.summary).name) for p in probes] == [
        ("llama-3.1-8b", 16, 1, "cold-8b-r16.json"), ("llama-3.1-8b", 16, 1, "cold-8b-r16.json"),
        ("llama-3.1-8b", 8, 1, "cold-8b-r8.json"), ("llama-3.1-8b", 64, 4, "issue30-small"),
        ("llama-3.1-8b", 64, 4, "before")]
    assert Path(probes[1].out).parent.name == "before" and str(before) in commands[2]
    assert probes[0].adapters == probes[1].adapters  # the same file, read warm by both trees
    assert all({"process"} == {v[0] for v in variants(p.variants)} for p in probes[:3])
    fixed = [c for c in commands if "bench.probes.fixed_costs" in c or any(a.endswith("fixed_costs.py") for a in c)]
    assert len(fixed) == 2 and str(before) in fixed[1] and fixed[1][-1].endswith("before/fixed.json")
    assert [c for c in _dry("issue30_small.sh", str(tmp_path), "before") if c] == []  # no BEFORE: skipped


def test_cold_path_runs_the_read_tests_and_each_probe_with_options_it_accepts(tmp_path: Path) -> None:
    commands = _dry("cold_path.sh", str(tmp_path), TP="2", ADAPTERS=str(tmp_path / "ad"))
    assert [c[2] for c in commands] == ["pytest", "pytest"] + ["bench.probes.cold_read"] * 3
    runs = [cold_read_parser().parse_args(c[3:]) for c in commands[2:]]
    assert [(a.model, a.rank, a.tp, Path(a.out).name) for a in runs] == [
        ("llama-3.1-8b", 16, 2, "cold-8b-r16.json"), ("llama-3.1-8b", 64, 2, "cold-8b-r64.json"),
        ("llama-3.1-70b", 64, 2, "cold-70b-r64.json")]
    assert all(a.adapters.startswith(str(tmp_path / "ad")) and "1" in a.readers.split(",") for a in runs)
    assert [c[2] for c in _dry("cold_path.sh", str(tmp_path), "70b-r64")] == ["bench.probes.cold_read"]


def test_parallel_gives_each_scenario_its_gpus(tmp_path: Path) -> None:
    commands = _dry("parallel.sh", str(tmp_path), "seed@0", "zipf@1,2", ADAPTERS=str(tmp_path / "ad"))
    assert commands[0][:2] == ["python", "-"] and commands[0][2:4] == ["seed", "zipf"]  # the adapters first
    assert sorted(c[c.index("--scenario") + 1] for c in commands[1:]) == ["seed", "zipf"]


def test_issue42_runs_each_part_with_its_store_and_router(tmp_path: Path) -> None:
    """issue42.sh: the device store behind affinity and Route, the page-cache store, each a bench.run of its own."""
    runs = [" ".join(c) for c in _dry("issue42.sh", str(tmp_path), "dev2-aff", "dev2-route", "pc2-aff")]
    assert len(runs) == 3
    assert "--store device --router affinity --policies queue,global,oracle" in runs[0]
    assert "--store device --router lora-cache --policies global" in runs[1]
    assert "--store page-cache --router affinity" in runs[2]
    assert all("--warmup-requests 300" in r and "--replicas 2" in r for r in runs)


def test_issue42_gives_a_run_that_makes_the_catalog_more_time(tmp_path: Path) -> None:
    """A run that finds ADAPTERS short of the catalog makes it within its step (a fresh machine): it gets MAKE_S more
    than STEP_LIMIT (the first policy of a fresh machine was cut at 175 s, twice); with the catalog there,
    STEP_LIMIT."""
    empty, full = tmp_path / "empty", tmp_path / "full"
    for i in range(3):
        (full / f"adapter-{i:03d}").mkdir(parents=True)
        (full / f"adapter-{i:03d}" / "adapter_config.json").write_text("{}")
    env = {"NUM_ADAPTERS": "3", "STEP_LIMIT": "175", "MAKE_S": "200"}
    (fresh,) = _dry("issue42.sh", str(tmp_path / "o1"), "dev1-seed", ADAPTERS=str(empty), **env)
    (warm,) = _dry("issue42.sh", str(tmp_path / "o2"), "dev1-seed", ADAPTERS=str(full), **env)
    assert fresh[:4] == ["timeout", "-k", "15", "375"] and warm[:4] == ["timeout", "-k", "15", "175"]


def test_issue42_pair_part_names_each_run_by_seed_and_adapter_lanes(tmp_path: Path) -> None:
    """dev2-pair: `global` behind Route and `queue` behind affinity for one seed, each a bench.run whose directory
    names the seed and --max-adapters (calls for several seeds write beside each other)."""
    runs = _dry("issue42.sh", str(tmp_path), "dev2-pair", SEED="2", MAX_ADAPTERS="8")
    assert len(runs) == 2
    assert [" ".join(r[r.index("--router"):r.index("--router") + 4]) for r in runs] == [
        "--router lora-cache --policies global", "--router affinity --policies queue"]
    for run, name in zip(runs, ("dev2-route-m8-s2", "dev2-queue-m8-s2")):
        assert run[run.index("--workload-seed") + 1] == "2" and run[run.index("--max-adapters") + 1] == "8"
        assert run[run.index("--out") + 1] == str(tmp_path / name)
    assert _dry("issue42.sh", str(tmp_path), "dev2-queue", SEED="2", MAX_ADAPTERS="8") == runs[1:]  # the second alone


def test_issue42_shared_gpu_part_runs_two_replicas_of_half_a_gpu_behind_route_and_affinity(tmp_path: Path) -> None:
    """sh2: two replicas of TP 1 sharing one GPU (--gpu-share 0.5), `global` behind Route and behind affinity and
    `queue` behind affinity, each a bench.run named by the store, the lanes and the seed."""
    runs = _dry("issue42.sh", str(tmp_path), "sh2", SEED="1", MAX_ADAPTERS="8", SH2_STORE="s3:200MBps,30ms")
    assert [" ".join(r[r.index("--router"):r.index("--router") + 4]) for r in runs] == [
        "--router lora-cache --policies global", "--router affinity --policies global",
        "--router affinity --policies queue"]
    for run, name in zip(runs, ("sh2-route-global-s3-m8-s1", "sh2-aff-global-s3-m8-s1", "sh2-aff-queue-s3-m8-s1")):
        assert run[run.index("--gpu-share") + 1] == "0.5" and run[run.index("--replicas") + 1] == "2"
        assert run[run.index("--tp") + 1] == "1" and run[run.index("--store") + 1] == "s3:200MBps,30ms"
        assert run[run.index("--workload-seed") + 1] == "1" and run[run.index("--out") + 1] == str(tmp_path / name)


def test_issue42_shared_gpu_part_runs_the_runs_sh2_runs_names_in_its_order_and_refuses_an_unknown_one(
        tmp_path: Path) -> None:
    """SH2_RUNS picks sh2's runs and their order (three do not fit one device call); a name it does not know fails
    the script before any run, naming the ones it knows."""
    runs = _dry("issue42.sh", str(tmp_path), "sh2", SEED="2", SH2_RUNS="aff-global route-global")
    assert [r[r.index("--out") + 1] for r in runs] == [str(tmp_path / "sh2-aff-global-device-m4-s2"),
                                                      str(tmp_path / "sh2-route-global-device-m4-s2")]
    done = subprocess.run(["bash", str(GPU / "issue42.sh"), str(tmp_path), "sh2"],
                          env={**os.environ, "DRY": "1", "PYTHON": "python", "SH2_RUNS": "route-global route-queue"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "=== " not in done.stdout
    assert "SH2_RUNS: unknown run route-queue; give route-global, aff-global or aff-queue" in done.stderr


def test_issue42_order_part_runs_the_shared_gpu_fleet_once_per_demand_fetch_order(tmp_path: Path) -> None:
    """sh2-order: sh2's fleet on the S3 store, `global` behind Route once with the node's demand fetches in order and
    once sharing the store (an A/B in one call), each run named by its order; the orders parse."""
    runs = _dry("issue42.sh", str(tmp_path), "sh2-order", SEED="2")
    assert len(runs) == 2
    for run, order in zip(runs, ("soonest", "shared")):
        args = build_parser().parse_args(run[run.index("bench.run") + 1:])
        assert (args.fetch_order, args.store, args.replicas, args.gpu_share) == (order, "s3:200MBps,30ms", 2, 0.5)
        assert run[run.index("--out") + 1] == str(tmp_path / f"sh2-order-{order}-global-lora-cache-s3-m4-s2")


def test_issue42_tiers_part_runs_global_behind_route_under_both_tiers_for_one_seed(tmp_path: Path) -> None:
    """dev2-tiers: the A/B of exclusive host tiers in one call, each run named by its tiers; the part's --host-tiers is
    after the common one (TIERS), so it is the one argparse keeps."""
    runs = _dry("issue42.sh", str(tmp_path), "dev2-tiers", SEED="3", MAX_ADAPTERS="8", TIERS="exclusive")
    assert len(runs) == 2
    for run, tiers in zip(runs, ("inclusive", "exclusive")):
        assert [run[i + 1] for i, a in enumerate(run) if a == "--host-tiers"][-1] == tiers
        assert run[run.index("--out") + 1] == str(tmp_path / f"dev2-route-m8-s3-{tiers}")
        assert " ".join(run[run.index("--router"):run.index("--router") + 4]) == "--router lora-cache --policies global"
        assert build_parser().parse_args(run[run.index("bench.run") + 1:]).host_tiers == tiers


def test_issue42_full_host_tier_part_overrides_the_host_bytes_and_routes_the_oracle_by_route(tmp_path: Path) -> None:
    """dev2-full: a host tier that holds the catalog, three bench.runs; the oracle behind Route (no lower bound behind
    affinity at 4 adapter lanes); the last --host-bytes wins in argparse, so the part's is after the common one."""
    runs = _dry("issue42.sh", str(tmp_path), "dev2-full", "dev2-oracle-route", SEED="1")
    assert len(runs) == 4
    for run in runs[:3]:
        hosts = [run[i + 1] for i, a in enumerate(run) if a == "--host-bytes"]
        assert hosts[-1] == "25769803776"
    for run in runs:
        assert "--workload-seed" in run and run[run.index("--workload-seed") + 1] == "1"
    assert runs[3][runs[3].index("--out") + 1].endswith("dev2-oracle-route-s1")
    assert [" ".join(r[r.index("--router"):r.index("--router") + 4]) for r in runs] == [
        "--router lora-cache --policies global", "--router affinity --policies queue,global",
        "--router lora-cache --policies oracle", "--router lora-cache --policies oracle"]


def test_issue42_s3_part_gives_the_disk_tier_its_size_when_asked_and_names_the_run_by_it(tmp_path: Path) -> None:
    """s3-1: one replica on the S3 store; DISK_BYTES, where given, is the node's disk tier (``--disk-bytes``, a
    bench.run option) and names the run; without it the service's default (no option)."""
    (sized,) = _dry("issue42.sh", str(tmp_path), "s3-1", DISK_BYTES=str(8 << 30), POLICIES="global", SEED="1")
    assert sized[sized.index("--disk-bytes") + 1] == str(8 << 30) and sized[sized.index("--policies") + 1] == "global"
    assert sized[sized.index("--out") + 1].endswith("s3-1-m4-s1-d8-global")
    (default,) = _dry("issue42.sh", str(tmp_path), "s3-1")
    assert "--disk-bytes" not in default and default[default.index("--out") + 1].endswith("s3-1-m4-s0-queue-global")


def test_issue44_push_runs_the_passes_then_each_push_probe_for_this_tree_and_then_the_old_one(tmp_path: Path) -> None:
    from bench.probes.push import build_parser as push_parser

    old = tmp_path / "old"
    old.mkdir()
    commands = _dry("issue44_push.sh", str(tmp_path / "out"), OLD=str(old), SITE=str(tmp_path / "site"), ROUNDS="2",
                    DRY_GPUS="2")
    assert [c[2] for c in commands[:2]] == ["bench.probes.push_passes"] * 2
    pushes = commands[2:]
    assert len(pushes) == 6 and [c[0] for c in pushes] == ["python", "env"] * 3
    for now, before in zip(pushes[::2], pushes[1::2]):
        args = push_parser().parse_args(now[3:])
        assert args.tp == 2 and args.out.startswith(str(tmp_path / "out"))
        assert before[:6] == ["env", "-C", str(old), f"PYTHONPATH={tmp_path / 'site'}:{old}", "python", "-m"]
        old_args = push_parser().parse_args(before[7:])
        assert (old_args.tp, old_args.model, old_args.rank, old_args.pushes) == (2, args.model, args.rank, args.pushes)
        assert old_args.out != args.out
    assert [push_parser().parse_args(c[3:]).model for c in pushes[::2]] == ["llama-3.1-8b"] * 2 + ["llama-3.1-70b"]
    assert len(_dry("issue44_push.sh", str(tmp_path / "out2"))) == 5  # no OLD: this tree's probes alone
    # ARGS reach both trees' probes (the old tree runs this tree's probe); PUSHES70=0 leaves the 70B out
    shared = _dry("issue44_push.sh", str(tmp_path / "out3"), OLD=str(old), SITE=str(tmp_path / "site"), ROUNDS="1",
                  PUSHES70="0", PARTS="push", ARGS="--source gpu --one-gpu", TP="2")
    parsed = [push_parser().parse_args(shared[0][3:]), push_parser().parse_args(shared[1][7:])]
    assert len(shared) == 2 and all((a.source, a.one_gpu, a.tp, a.model) == ("gpu", True, 2, "llama-3.1-8b")
                                    for a in parsed)


def test_issue44_push_times_request_time_resolution_on_the_gpu_when_asked(tmp_path: Path) -> None:
    from bench.probes.resolve_ttft import build_parser as resolve_parser

    commands = _dry("issue44_push.sh", str(tmp_path / "out"), PARTS="resolve", RESOLVE_RANKS="16 64")
    assert [c[2] for c in commands] == ["bench.probes.resolve_ttft"] * 2
    parsed = [resolve_parser().parse_args(c[3:]) for c in commands]
    assert [(a.model, a.rank, a.device, a.latency_ms) for a in parsed] == [("llama-3.1-8b", 16, "cuda", "0,20"),
                                                                           ("llama-3.1-8b", 64, "cuda", "0,20")]
    assert all(a.out.startswith(str(tmp_path / "out")) for a in parsed)


def test_issue44_push_loop_part_alternates_the_pass_niceness_with_options_the_probe_accepts(tmp_path: Path) -> None:
    from bench.probes.push_loop import build_parser as loop_parser

    commands = _dry("issue44_push.sh", str(tmp_path), PARTS="loop", LOOP_ROUNDS="3")
    settings = [c[1] for c in commands]  # env LORA_CACHE_PUSH_NICE=N python -m ...
    assert settings == [f"LORA_CACHE_PUSH_NICE={n}" for n in (0, 10, 10, 0, 0, 10)]  # reversed every other round
    assert {c[4] for c in commands} == {"bench.probes.push_loop"}
    parsed = [loop_parser().parse_args(c[5:]) for c in commands]
    assert all(a.gpu and a.tp == 1 and a.source == "gpu" and not a.audit for a in parsed)
    assert len({a.summary for a in parsed}) == 6
    commands = _dry("issue44_push.sh", str(tmp_path), PARTS="loop", LOOP_ROUNDS="2", SOURCES="cpu gpu", NICES="0")
    parsed = [loop_parser().parse_args(c[5:]) for c in commands]
    assert [a.source for a in parsed] == ["cpu", "gpu", "gpu", "cpu"]  # where the trainer's tensors are, alternated
    assert [Path(a.summary).name for a in parsed] == ["loop-cpu-n0-1.json", "loop-gpu-n0-1.json", "loop-gpu-n0-2.json",
                                                      "loop-cpu-n0-2.json"]


def test_issue44_push_read_part_runs_the_device_read_tests_then_the_probe_at_both_shapes(tmp_path: Path) -> None:
    from bench.probes.device_read import build_parser as read_parser

    commands = _dry("issue44_push.sh", str(tmp_path), PARTS="read")
    assert commands[0][-3:] == ["-m", "gpu", "tests/test_device_read.py"]
    parsed = [read_parser().parse_args(c[3:]) for c in commands[1:]]
    assert [(a.model, a.rank, a.tp) for a in parsed] == [("llama-3.1-8b", 16, "1,2"), ("llama-3.1-70b", 64, "1,2")]
    assert [Path(a.out).name for a in parsed] == ["read-8b.json", "read-70b.json"]


def test_issue44_push_slots_part_runs_the_image_load_tests_then_the_probe_at_both_shapes(tmp_path: Path) -> None:
    from bench.probes.push_slots import build_parser as slots_parser

    commands = _dry("issue44_push.sh", str(tmp_path), PARTS="slots")
    assert commands[0][-3:] == ["gpu", "tests/test_image_loads.py", "tests/test_device_read.py"]
    parsed = [slots_parser().parse_args(c[3:]) for c in commands[1:]]
    assert [(a.model, a.rank, a.tp, a.device) for a in parsed] == [("llama-3.1-8b", 16, "1,2", "cuda"),
                                                                    ("llama-3.1-70b", 64, "1,2", "cuda")]
    assert [Path(a.out).name for a in parsed] == ["slots-8b.json", "slots-70b.json"]


def test_issue44_push_device_part_runs_the_trainers_device_push_at_each_tp_and_the_70b(tmp_path: Path) -> None:
    from bench.probes.push import build_parser as push_parser

    commands = _dry("issue44_push.sh", str(tmp_path), PARTS="device")
    assert commands[0][-3:] == ["-m", "gpu", "tests/test_image_loads.py"]
    VIA = "device,device-now,ray"  # registered ahead, registered at the call, by Ray reference: in turn
    parsed = [push_parser().parse_args(c[3:]) for c in commands[1:]]
    assert [(a.model, a.rank, a.tp, a.via, a.source, a.one_gpu) for a in parsed] == [
        ("llama-3.1-8b", 16, 1, VIA, "gpu", True), ("llama-3.1-8b", 16, 2, VIA, "gpu", True),
        ("llama-3.1-70b", 64, 2, VIA, "gpu", True)]
    assert [Path(a.out).name for a in parsed] == ["device-8b-tp1.json", "device-8b-tp2.json", "device-70b-tp2.json"]
    assert len(_dry("issue44_push.sh", str(tmp_path / "two"), PARTS="device", PUSHES70="0", DEVICE_TPS="1")) == 2
