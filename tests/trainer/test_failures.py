"""Failure handling (issue 13), each failure injected: a torn metrics line, divergence (NaN), a
corrupt checkpoint, two runs on one out directory, a killed launcher, Ctrl-C, a full disk, a
checkpoint of another model, unusable CLI inputs and a busy Prometheus port."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import logged, spawn
from test_checkpoint import Position, checkpointer, counting_hashes, make, train_steps
from test_train import ROOT, local_plan, losses, write_plan

from supernode.cli import main as cli
from supernode.components.aws.monitoring import LogPattern
from supernode.core.checkpoints import COMPLETE, complete_checkpoints, read_marker
from supernode.core.config import from_mapping, load_stack
from supernode.core.errors import BadInput
from supernode.core.outdir import OutDirLock
from supernode.core.plan import build_local_plan
from supernode.core.runs import checkpoints_of, run_of
from supernode.trainer.checkpoint import CheckpointCorrupt, CheckpointMismatch
from supernode.trainer.data.manifest import DataError, verify
from supernode.trainer.data.prepare import DEFAULT_CORPUS, prepare
from supernode.trainer.engine import apply_hyper_parameters, lr_factor
from supernode.trainer.launch import STALLS
from supernode.trainer.metrics import JSONL, Metrics


def one_rank_plan(model: dict | None = None, **training):
    """The dev stack's local plan on a single rank (ep 1), training overrides in camelCase."""
    data = load_stack("dev", ROOT).to_mapping()
    data["local"]["training"].update({"warmupSteps": 1, **training})
    data["local"]["parallel"].update({"dpShard": 1, "ep": 1})
    data["local"]["nproc"] = 1
    data["local"]["model"].update(model or {})
    return build_local_plan("dev", from_mapping(data), 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def strict_records(path: Path) -> list[dict]:
    """Every line parsed as strict JSON: a bare NaN/Infinity or a torn line fails the test."""

    def no_constants(name):
        raise AssertionError(f"{name} in {path}: not JSON")

    return [json.loads(line, parse_constant=no_constants) for line in path.read_text().splitlines()]


def trainer_alone(
    plan: Path, data: Path, out: Path, *flags: str, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """`python -m supernode.trainer.train` as a single rank, without torchrun."""
    env = dict(
        os.environ,
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
        **(env or {}),
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "supernode.trainer.train",
            "--plan",
            str(plan),
            "--data",
            str(data),
            "--out",
            str(out),
            *flags,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def launcher(out: Path, *flags: str, env: dict | None = None) -> subprocess.Popen:
    """`supernode train --local` in a process group of its own, as a shell runs it."""
    cmd = [
        sys.executable,
        "-m",
        "supernode",
        "train",
        "--stack",
        "dev",
        "--root",
        str(ROOT),
        "--local",
        "--out",
        str(out),
        *flags,
    ]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
    )


def wait_for_metrics_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        try:
            if max(losses(out), default=0) >= step:
                return
        except (OSError, ValueError):  # not there yet, or a line half written
            pass
        time.sleep(0.1)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += map(int, (task / "children").read_text().split())
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has stopped running


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokens")
    prepare(DEFAULT_CORPUS, out, shard_tokens=1 << 16)
    return out


@pytest.fixture(scope="module")
def plan():
    return one_rank_plan()


# 1 -----------------------------------------------------------------------------------------------


def _log(m: Metrics, step: int, loss: float, grad_norm: float = 0.5):
    return m.log(
        step,
        loss=loss,
        lr=1e-3,
        grad_norm=grad_norm,
        tokens=1024,
        step_s=0.5,
        compute_s=0.3,
        comm_s=0.1,
        data_s=0.1,
        expert_load=None,
    )


def test_torn_metrics_line_is_dropped_on_resume_and_writes_cannot_stop_training(tmp_path, plan):
    m = Metrics(tmp_path, plan, world_size=1, device_type="cpu")
    for step in (1, 2, 3):
        _log(m, step, 5.0 - step)
    with (tmp_path / JSONL).open("a") as f:  # the disk filled up (or a kill came) mid-append
        f.write('{"step": 4, "loss": 1.5, "mfu": ')
    m = Metrics(tmp_path, plan, world_size=1, device_type="cpu", start_step=3)  # the resume
    _log(m, 4, 1.25)
    assert [(r["step"], r["loss"]) for r in strict_records(tmp_path / JSONL)] == [
        (1, 4.0),
        (2, 3.0),
        (3, 2.0),
        (4, 1.25),
    ]
    # A diverged step is still JSON (null), and a write that fails does not raise.
    _log(m, 5, float("nan"), grad_norm=float("inf"))
    assert (
        strict_records(tmp_path / JSONL)[-1]["loss"] is None
        and strict_records(tmp_path / JSONL)[-1]["grad_norm"] is None
    )
    (tmp_path / JSONL).unlink()
    (tmp_path / JSONL).mkdir()  # every later append fails with an OSError, as on a full disk
    assert _log(m, 6, 1.0).step == 6


# 2 -----------------------------------------------------------------------------------------------


def lines_matching(pattern: str, log: str) -> list[str]:
    """The log's lines a CloudWatch Logs term pattern matches: `"a" "b"` needs every term in the line,
    `?"a" ?"b"` any of them (what the log alarms' metric filters count)."""
    terms = re.findall(r'(\??)"([^"]*)"', pattern)
    assert len({optional for optional, _ in terms}) == 1, pattern  # all terms, or any one of them
    test = any if terms[0][0] else all
    return [line for line in log.splitlines() if test(term in line for _, term in terms)]


@pytest.mark.slow
def test_nan_loss_skips_updates_then_stops_nonzero_without_a_nan_checkpoint(tmp_path, data_dir):
    plan = write_plan(one_rank_plan(steps=30, checkpointInterval=2, maxNonFiniteSteps=3), tmp_path / "plan.json")
    out = tmp_path / "out"
    r = trainer_alone(plan, data_dir, out, "--sync-checkpoint", env={"SUPERNODE_INJECT_FAULT": "nan@5"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "training diverged: loss or gradient norm not finite for 3 consecutive steps (steps 5-7" in r.stderr
    assert "The checkpoint of step 4 holds the last finite state" in r.stderr and "Traceback" not in r.stderr
    assert "step 5: loss nan, grad norm nan: not finite, update skipped (1 in a row of at most 3)" in r.stdout
    # the log alarms count what this run printed: 3 skipped steps, checkpoints 2 and 4, one start
    assert len(lines_matching(LogPattern.NON_FINITE, r.stdout)) == 3
    assert [line.split(":")[0] for line in lines_matching(LogPattern.CHECKPOINT, r.stdout)] == ["step 2", "step 4"]
    assert len(lines_matching(LogPattern.TRAINER_START, r.stdout)) == 1
    assert [s for s, _ in complete_checkpoints(checkpoints_of(out))] == [2, 4]  # 6 would be a skipped step's
    recs = strict_records(run_of(out) / JSONL)  # valid JSON throughout
    assert [(r["step"], r["loss"], r["skipped"]) for r in recs if r["step"] >= 5] == [
        (5, None, True),
        (6, None, True),
        (7, None, True),
    ]
    assert all(isinstance(r["loss"], float) for r in recs if r["step"] < 5)


# 3 -----------------------------------------------------------------------------------------------


def flip(path: Path, offset: int = 64) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + 8] = b"\xff" * 8
    path.write_bytes(bytes(data))


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(group, tmp_path):
    model, opt, sched = make(0)
    position = Position(0, 2)
    ck = checkpointer(tmp_path, model, opt, sched, position, keep=3, async_save=False)
    ck.save(2)
    good = model[0].weight.detach().clone()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    position.sd["position"] = 4
    ck.save(4)
    flip(tmp_path / "step_00000004" / "__0_0.distcp")

    model2, opt2, sched2 = make(1)
    ck = checkpointer(tmp_path, model2, opt2, sched2, keep=3)
    with logged() as said:
        assert ck.restore() == 2
    assert torch.equal(model2[0].weight, good)
    assert said == [
        f"checkpoint {tmp_path / 'step_00000004'} is corrupt ({tmp_path / 'step_00000004' / '__0_0.distcp'} "
        "does not match its recorded sha256); resuming from the previous complete checkpoint, step 2"
    ]
    # Nothing usable at all: a clear error (exit 2 in the trainer), never a silent start from step 0.
    (tmp_path / "step_00000002" / ".metadata").write_bytes(b"garbage")
    with pytest.raises(
        CheckpointCorrupt,
        match=r"no usable checkpoint in .*step_00000004 is corrupt.*"
        r"step_00000002 is corrupt \(.*\.metadata does not match",
    ):
        ck.restore()


def corrupt_a_file_rank_1_checks(rank: int, world: int, root: Path):
    """Two ranks save steps 2 and 4; rank 0 flips bytes in the file of step 4 that rank 1 checks on
    restore (the second in name order), then both restore, counting what each hashes."""
    model, opt, sched = make(0, world)
    ck = checkpointer(root, model, opt, sched, keep=3, async_save=False)
    ck.save(2)
    train_steps(model, opt, sched, 1)
    ck.save(4)
    dist.barrier()  # rank 0 has committed step 4
    path = root / "step_00000004"
    corrupt = sorted(read_marker(path)["files"])[1]
    if rank == 0:
        flip(path / corrupt)
    dist.barrier()
    with counting_hashes() as hashed, logged(rank) as said:
        step = checkpointer(root, *make(1, world), keep=3).restore()
    return step, said, hashed, corrupt


@pytest.mark.slow
def test_a_corrupt_file_that_another_rank_checks_still_falls_back(tmp_path):

    root = tmp_path / "ck"
    ranks = spawn(corrupt_a_file_rank_1_checks, 2, tmp_path, root)
    (step0, said0, hashed0, corrupt), (step1, said1, hashed1, _) = ranks
    assert corrupt == "__0_0.distcp"  # written by rank 0, checked by rank 1
    assert corrupt in hashed1 and corrupt not in hashed0
    assert step0 == step1 == 2  # both ranks fall back together
    path = root / "step_00000004"
    assert said0 == [
        f"checkpoint {path} is corrupt ({path / corrupt} does not match its recorded sha256); "
        "resuming from the previous complete checkpoint, step 2"
    ]
    assert said1 == []  # said once, by rank 0


# 4 -----------------------------------------------------------------------------------------------


def test_a_second_run_on_the_same_out_directory_exits_2(tmp_path, data_dir, capsys):
    out = tmp_path / "out"
    first = OutDirLock(out)  # the first run, alive, holds the directory
    assert first.acquire() is None
    try:
        r = trainer_alone(write_plan(one_rank_plan(steps=2), tmp_path / "plan.json"), data_dir, out)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert (
            f"--out {out} is in use by another run (pid {os.getpid()} on host {socket.gethostname()} since" in r.stderr
        )
        assert cli(["train", "--stack", "dev", "--root", str(ROOT), "--local", "--out", str(out), "--steps", "2"]) == 2
        assert f"is in use by another run (pid {os.getpid()} on host" in capsys.readouterr().err
        assert not (out / "plan.json").exists()  # the holder's plan is not overwritten
        assert not (out / "checkpoints").exists() and not (out / "runs").exists()
    finally:
        first.release()
    assert OutDirLock(out).acquire() is None  # released with its holder


def test_a_commit_keeps_the_committed_checkpoint_until_the_new_one_is_in_place(group, tmp_path, monkeypatch):
    model, opt, sched = make(0)
    position = Position(0, 8)
    ck = checkpointer(tmp_path, model, opt, sched, position, keep=3, async_save=False)
    ck.save(8)
    before = (tmp_path / "step_00000008" / "__0_0.distcp").read_bytes()
    real = os.replace

    def crash_on_publish(src, dst):  # the process dies between moving the old one aside and publishing
        if Path(src).name.startswith(".tmp-step_"):
            raise OSError("killed")
        return real(src, dst)

    monkeypatch.setattr("supernode.trainer.checkpoint.os.replace", crash_on_publish)
    with pytest.raises(OSError, match="killed"):
        position.sd["position"] = 99
        ck.save(8)  # the same step again (a resume from an earlier one)
    monkeypatch.undo()
    data = Position()
    restarted = checkpointer(tmp_path, *make(1), data, keep=3)  # start-up puts the committed one back
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [8]
    assert (tmp_path / "step_00000008" / "__0_0.distcp").read_bytes() == before
    assert restarted.restore() == 8 and data.sd == {"epoch": 0, "position": 8}


# 5, 6 --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_launcher_trains_as_a_containers_pid_1(tmp_path, data_dir):
    """A pod's command is PID 1 of its PID namespace, so torchrun's workers are children of PID 1.
    The workers' orphan check read "my parent is PID 1" as "my parent died" and every worker of every
    cluster job exited 1 at start; they now compare with the agent's PID, which the launcher names.
    Run in a PID namespace of its own, as a container runtime starts it (needs root for unshare)."""
    if os.geteuid() != 0:
        pytest.skip("a PID namespace needs root (unshare --pid)")
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"cannot make a PID namespace here: {probe.stderr.decode().strip()}")
    plan = write_plan(one_rank_plan(steps=2, checkpointInterval=2), tmp_path / "plan.json")
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", "import os; print(os.getpid())"]
    assert subprocess.run(cmd, capture_output=True, text=True).stdout.strip() == "1"  # PID 1 there, as in a pod
    cmd[4:] = [sys.executable, "-m", "supernode.trainer.launch", "--standalone", "--nproc-per-node", "1"]
    cmd += ["--max-restarts", "0", "--module", "supernode.trainer.train", "--plan", str(plan)]
    cmd += ["--data", str(data_dir), "--out", str(tmp_path / "out")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert max(losses(tmp_path / "out")) == 2


@pytest.mark.slow
def test_sigkill_of_the_launchers_process_group_leaves_no_worker_alive(tmp_path):
    out = tmp_path / "out"
    proc = launcher(out, "--steps", "500", "--log-every", "1")
    try:
        wait_for_metrics_step(out, 2, proc)
        (agent,) = children(proc.pid)
        workers = children(agent)
        assert len(workers) == 2
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(alive(p) for p in [agent, *workers]):
            time.sleep(0.1)
        assert not [p for p in [agent, *workers] if alive(p)], "processes outlived the launcher"
    finally:
        proc.kill()
        proc.communicate()


@pytest.mark.slow
def test_ctrl_c_finishes_the_step_writes_a_checkpoint_and_exits_130(tmp_path):
    out = tmp_path / "out"
    proc = launcher(out, "--steps", "500", "--log-every", "1")
    wait_for_metrics_step(out, 3, proc)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, log[-3000:]
    ((stopped, _),) = complete_checkpoints(checkpoints_of(out))
    assert stopped >= 3 and f"interrupted at step {stopped}; checkpoint written; run again to resume" in log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log and "SignalException" not in log
    assert max(losses(out)) == stopped


# 7 -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_full_disk_is_reported_once_without_restarts(tmp_path):
    out = tmp_path / "out"
    proc = launcher(out, "--steps", "3", env={"SUPERNODE_INJECT_FAULT": "enospc@3"})
    log, _ = proc.communicate(timeout=180)
    assert proc.returncode == 1, log[-3000:]
    assert log.count("no space left on") == 1 and log.count("starting at step 0") == 1  # no restart ran
    assert f"error: no space left on {checkpoints_of(out)}: the checkpoint of step 3 needs ~" in log
    assert "Traceback" not in log and "ChildFailedError" not in log
    assert complete_checkpoints(checkpoints_of(out)) == [] and not list(checkpoints_of(out).glob(".tmp-*"))


# 8 -----------------------------------------------------------------------------------------------


def test_a_checkpoint_of_another_model_is_refused_naming_the_fields(group, tmp_path):
    model, opt, sched = make(0)
    meta = {"model": {"heads": 4, "kv_heads": 2, "top_k": 2, "router": "softmax"}}
    checkpointer(tmp_path, model, opt, sched, keep=1, async_save=False, meta=meta).save(1)
    other = {"model": {"heads": 8, "kv_heads": 2, "top_k": 1, "router": "sigmoid"}}  # same tensor shapes
    with pytest.raises(
        CheckpointMismatch,
        match=r"step_00000001 was written for another model \(model\.heads 4 -> 8, "
        r"router 'softmax' -> 'sigmoid', top_k 2 -> 1\)",
    ):
        checkpointer(tmp_path, *make(1), keep=1, meta=other).restore()


def test_a_changed_schedule_is_applied_and_said(tmp_path):
    old, new = (
        one_rank_plan(lr=0.003, schedule="cosine").training,
        one_rank_plan(lr=0.001, schedule="constant").training,
    )
    model, opt, _ = make(0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(new))
    for g in opt.param_groups:  # as the checkpoint left them
        g["lr"] = g["initial_lr"] = 0.003
    sched.base_lrs, sched.last_epoch = [0.003], 30
    saved = {k: getattr(old, k) for k in ("lr", "schedule", "steps", "warmup_steps")}
    line = apply_hyper_parameters(new, saved, 30, opt, sched)
    assert line == (
        "checkpoint of step 30 was trained with other settings: training.lr 0.003 -> 0.001, "
        "training.schedule 'cosine' -> 'constant'; the plan's values apply from step 31"
    )
    assert opt.param_groups[0]["lr"] == pytest.approx(0.001) and sched.get_last_lr() == [pytest.approx(0.001)]
    opt.step()  # no gradients: only the order torch expects
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.001)
    assert apply_hyper_parameters(new, {k: getattr(new, k) for k in saved}, 30, opt, sched) is None


@pytest.mark.slow
def test_resuming_with_a_changed_model_exits_2(tmp_path, data_dir):
    out = tmp_path / "out"
    first = trainer_alone(write_plan(one_rank_plan(steps=2), tmp_path / "a.json"), data_dir, out, "--sync-checkpoint")
    assert first.returncode == 0, first.stderr
    other = one_rank_plan(model={"topK": 1}, steps=4)  # the same tensor shapes: DCP alone would load it
    r = trainer_alone(write_plan(other, tmp_path / "b.json"), data_dir, out)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "was written for another model (model.top_k 2 -> 1)" in r.stderr


# 9 -----------------------------------------------------------------------------------------------


def test_unusable_plan_files_exit_2(tmp_path, data_dir):
    (tmp_path / "latin1.json").write_bytes(b'{"stack": "d\xe9v"}')
    for plan, message in (
        (tmp_path, "is a directory, not a plan file"),
        (tmp_path / "latin1.json", "not UTF-8 text (byte 12)"),
    ):
        r = trainer_alone(plan, data_dir, tmp_path / "out")
        assert r.returncode == 2 and f"error: --plan {plan}: {message}" in r.stderr and "Traceback" not in r.stderr


def test_bad_manifests_and_out_paths_exit_2(tmp_path, capsys):
    data = tmp_path / "data"
    prepare(DEFAULT_CORPUS, data, shard_tokens=1 << 18)
    manifest = json.loads((data / "manifest.json").read_text())

    def rewrite(**changes):
        (data / "manifest.json").write_text(json.dumps({**manifest, **changes}))

    rewrite(dtype="float32")
    with pytest.raises(DataError, match=r"dtype 'float32' is not a token id type; use one of uint8, uint16, uint32"):
        verify(data)
    rewrite(dtype="uint16")  # the same bytes read as uint16: half the tokens the manifest lists
    with pytest.raises(
        DataError,
        match=r"shard_00000.bin is corrupt: 129100 tokens of uint16 \(258200 bytes\), "
        r"manifest says 258200: a corrupt shard or a wrong dtype",
    ):
        verify(data)
    rewrite(dtype="uint8")
    args = ["train", "--stack", "dev", "--root", str(ROOT), "--local", "--data", str(data)]
    rewrite(dtype="int64")
    assert cli([*args, "--out", str(tmp_path / "o1")]) == 2
    assert "dtype 'int64' is not a token id type" in capsys.readouterr().err
    rewrite()
    (tmp_path / "file").write_text("x")
    assert cli(["data", "prepare", "--out", str(tmp_path / "file")]) == 2
    assert f"--out {tmp_path / 'file'} is an existing file, not a directory" in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "x"


def test_token_ids_outside_the_vocab_are_bad_input(tmp_path):
    from supernode.trainer.data.loader import TokenLoader

    prepare(DEFAULT_CORPUS, tmp_path, shard_tokens=1 << 18)
    with pytest.raises(DataError, match=r"holds token id 2\d\d, outside the model's vocab of 128"):
        TokenLoader(tmp_path, 64, 4, 4, 0, 1, 0, vocab=128)


def test_fewer_steps_than_the_run_already_has_exits_2(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "checkpoints" / "step_00000030").mkdir(parents=True)
    (out / "checkpoints" / "step_00000030" / COMPLETE).write_text("{}")
    assert cli(["train", "--stack", "dev", "--root", str(ROOT), "--local", "--out", str(out), "--steps", "10"]) == 2
    assert f"in {out} is already at step 30; give --steps above 30" in capsys.readouterr().err


# 10 ----------------------------------------------------------------------------------------------


def test_prometheus_listens_on_loopback_and_a_busy_port_is_a_plain_error(tmp_path, plan):
    port = free_port()
    m = Metrics(tmp_path, plan, world_size=1, device_type="cpu", prometheus_port=port)
    try:
        assert m.http.server_address[0] == "127.0.0.1"
        with pytest.raises(BadInput, match=rf"--prometheus-port {port} on 127.0.0.1 is in use by another process"):
            Metrics(tmp_path / "b", plan, world_size=1, device_type="cpu", prometheus_port=port)
    finally:
        m.close()


# Issue 30 ----------------------------------------------------------------------------------------


def cluster_launcher(
    plan: Path,
    data: Path,
    out: Path,
    *flags: str,
    torchrun_flags: tuple[str, ...] = (),
    env: dict | None = None,
    node: tuple[int, int, int] | None = None,
) -> subprocess.Popen:
    """`python -m supernode.trainer.launch` (the PyTorchJob's command) in a session of its own, as a terminal
    or a container runtime starts it: alone, or as node `rank` of `nodes` meeting on `port` of this
    host (node=(rank, nodes, port)), as each pod of a job runs it."""
    world = json.loads(plan.read_text())["world_size"]
    if node is None:
        where = ["--standalone", "--nproc-per-node", str(world)]
    else:
        rank, nodes, port = node
        where = ["--nnodes", str(nodes), "--node-rank", str(rank), "--master-addr", "127.0.0.1"]
        where += ["--master-port", str(port), "--nproc-per-node", str(world // nodes)]
    cmd = [sys.executable, "-m", "supernode.trainer.launch", *where, "--max-restarts", "1", *torchrun_flags]
    cmd += ["--module", "supernode.trainer.train", "--plan", str(plan), "--data", str(data), "--out", str(out), *flags]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **(env or {})),
    )


@pytest.fixture
def reap():
    """`reap(proc)`: a process (with its session) the test started, killed when the test ends however."""
    procs: list[subprocess.Popen] = []

    def add(proc: subprocess.Popen) -> subprocess.Popen:
        procs.append(proc)
        return proc

    yield add
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its workers die with it (PR_SET_PDEATHSIG)
            proc.communicate()


def wait_for_child(pid: int, running: str, timeout: float = 60) -> int:
    """The first child of `pid` whose command line holds `running`, as soon as it exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in children(pid):
            try:
                if running.encode() in Path(f"/proc/{child}/cmdline").read_bytes():
                    return child
            except OSError:
                pass
        time.sleep(0.005)
    raise AssertionError(f"process {pid} started no {running} in {timeout} s")


@pytest.mark.slow
def test_sigterm_to_the_cluster_launcher_checkpoints_and_exits_143_without_a_traceback(tmp_path, data_dir, reap):
    """#4: eviction SIGTERMs the PyTorchJob's `python -m supernode.trainer.launch`. It exited 1 with a
    SignalException traceback, which `restartPolicy: ExitCode` treats as permanent; now the workers
    finish the step and checkpoint (within --shutdown-timeout, the pod's grace period) and it exits
    143, which the operator retries."""
    plan = write_plan(one_rank_plan(steps=500, checkpointInterval=100), tmp_path / "plan.json")
    out = tmp_path / "out"
    proc = reap(cluster_launcher(plan, data_dir, out, torchrun_flags=("--shutdown-timeout", "110")))
    wait_for_metrics_step(out, 2, proc)
    proc.send_signal(signal.SIGTERM)
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, log[-3000:]
    ((stopped, _),) = complete_checkpoints(checkpoints_of(out))
    assert f"SIGTERM: stopped after step {stopped} with a checkpoint; run again to resume" in log
    assert "Traceback" not in log and "SignalException" not in log


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["launcher", "workers"])
def test_ctrl_c_in_the_cluster_launchers_start_up_exits_130_at_once(tmp_path, data_dir, moment, reap):
    """#13: Ctrl-C while supernode.trainer.launch imports torch, or while its workers do, ended in a
    KeyboardInterrupt traceback and exit 1 (from the launcher, or from every worker). Now the run
    stops at once, exit 130, nothing trained."""
    plan = write_plan(one_rank_plan(steps=500), tmp_path / "plan.json")
    out = tmp_path / "out"
    proc = reap(cluster_launcher(plan, data_dir, out))
    if moment == "workers":
        wait_for_child(proc.pid, "supernode.trainer.train")
    time.sleep(0.3)  # into torch's import (seconds), past the interpreter's own start
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
    t0 = time.monotonic()
    log, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, log[-3000:]
    assert time.monotonic() - t0 < 10, "not at once"
    assert "Traceback" not in log and "KeyboardInterrupt" not in log
    assert not list(out.rglob(JSONL)) and not list(out.glob(".exit*"))


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["spawn", "launcher", "workers"])
def test_ctrl_c_while_supernode_train_starts_torchrun_exits_130_at_once(tmp_path, moment, reap):
    """#13: Ctrl-C during start-up was handed to workers still importing torch (a KeyboardInterrupt
    traceback each, then torchrun restarted them and the run trained to the end, exit 130) or to
    torchrun itself (a traceback, exit 1). Now at any moment: exit 130 at once, no traceback."""
    out = tmp_path / "out"
    proc = reap(launcher(out, "--steps", "500"))
    agent = wait_for_child(proc.pid, "supernode.trainer.train")  # torchrun's, whose command names the module
    if moment == "workers":
        wait_for_child(agent, "supernode.trainer.train")
    if moment != "spawn":  # "spawn": the moment it exists, in Python's own start-up
        time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
    t0 = time.monotonic()
    log, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, log[-3000:]
    assert time.monotonic() - t0 < 10, "not at once"
    assert "Traceback" not in log and "KeyboardInterrupt" not in log
    assert not list(out.rglob(JSONL))


@pytest.mark.slow
def test_a_refused_second_job_leaves_the_first_run_its_own_outcome(tmp_path, data_dir, reap):
    """#6: a second supernode.trainer.launch on a busy --out is refused (exit 2) but its rank 0 wrote
    {"code": 2} into the holder's OUT/.exit.json, so the first run trained to the end and exited 2.
    Each launcher now reads only the record made for it: here the second job has two nodes (two
    launchers, one shared OUT), and each of them exits 2 while the first run exits 0."""
    out = tmp_path / "out"
    first = reap(cluster_launcher(write_plan(one_rank_plan(steps=6), tmp_path / "a.json"), data_dir, out))
    wait_for_metrics_step(out, 1, first)
    (worker,) = children(first.pid)
    os.kill(worker, signal.SIGSTOP)  # the first run holds --out, mid-training, while the second tries it
    try:
        plan, port = write_plan(local_plan(2), tmp_path / "b.json"), free_port()
        nodes = [reap(cluster_launcher(plan, data_dir, out, node=(rank, 2, port))) for rank in (0, 1)]
        logs = [node.communicate(timeout=120)[0] for node in nodes]
    finally:
        os.kill(worker, signal.SIGCONT)
    assert [node.returncode for node in nodes] == [2, 2], logs[0][-3000:] + logs[1][-3000:]
    assert f"--out {out} is in use by another run (pid {worker} on host" in logs[0]  # said by rank 0, once:
    assert (logs[0] + logs[1]).count("is in use by another run") == 1  # no restart, no ChildFailedError
    assert "ChildFailedError" not in logs[0] + logs[1]  # (torch may log its exit barrier's teardown)
    log, _ = first.communicate(timeout=120)
    assert first.returncode == 0, log[-3000:]
    assert [s for s, _ in complete_checkpoints(checkpoints_of(out))] == [6]
    assert not list(out.glob(".exit*"))  # each launcher took its own record, and only that


@pytest.mark.slow
def test_a_run_that_ends_on_non_finite_steps_fails_and_checkpoints_none_of_them(tmp_path, data_dir):
    """#7: NaN from step 4 of 5 skipped steps 4-5 and wrote "step 5: loss nan; checkpoint written",
    exit 0: a checkpoint named step 5 holding step 3's weights. Now: exit 1, said once, and the
    latest checkpoint stays the last one trained through."""
    plan = write_plan(one_rank_plan(steps=5, checkpointInterval=2, maxNonFiniteSteps=3), tmp_path / "plan.json")
    out = tmp_path / "out"
    r = trainer_alone(plan, data_dir, out, "--sync-checkpoint", env={"SUPERNODE_INJECT_FAULT": "nan@4"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert (
        "error: training ended on non-finite steps: loss or gradient norm not finite at steps 4-5 (updates "
        "skipped), so the weights are still those of step 3; no checkpoint of step 5 written (the checkpoint "
        "of step 2 holds the last trained state)" in r.stderr
    )
    assert "Traceback" not in r.stderr and "step 5: loss nan; checkpoint" not in r.stdout
    assert [s for s, _ in complete_checkpoints(checkpoints_of(out))] == [2]


@pytest.mark.slow
def test_supernode_train_ending_on_a_non_finite_step_exits_1(tmp_path, reap):
    """#7 through `supernode train --local`, two ranks and the launcher's record: the last step
    skipped is a failure, said once, with no summary and no checkpoint of it."""
    out = tmp_path / "out"
    proc = reap(launcher(out, "--steps", "6", env={"SUPERNODE_INJECT_FAULT": "nan@6"}))
    log, _ = proc.communicate(timeout=180)
    assert proc.returncode == 1, log[-3000:]
    assert log.count("error: training ended on non-finite steps: loss or gradient norm not finite at step 6") == 1
    assert "Traceback" not in log and "tokens/s" not in log
    assert complete_checkpoints(checkpoints_of(out)) == []


@pytest.mark.slow
def test_sigterm_while_steps_are_skipped_stops_without_checkpointing_them(tmp_path, data_dir, reap):
    """#7 at a stop: the weights in a non-finite streak are an earlier step's, so the stop writes
    no checkpoint named after the step it stopped at, and says so."""
    plan = write_plan(one_rank_plan(steps=500, checkpointInterval=2, maxNonFiniteSteps=400), tmp_path / "plan.json")
    out = tmp_path / "out"
    proc = reap(cluster_launcher(plan, data_dir, out, env={"SUPERNODE_INJECT_FAULT": "nan@3"}))
    wait_for_metrics_step(out, 4, proc)
    proc.send_signal(signal.SIGTERM)
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, log[-3000:]
    stopped = int(log.split("SIGTERM: stopped after step ")[1].split()[0])
    assert (
        f"SIGTERM: stopped after step {stopped} without a checkpoint (steps 3-{stopped} not finite; the "
        "checkpoint of step 2 holds the last trained state); run again to resume" in log
    )
    assert [s for s, _ in complete_checkpoints(checkpoints_of(out))] == [2]


def test_the_summary_counts_skipped_steps(tmp_path, capsys):
    """#7: the closing summary read only the steps with a loss, so skipped ones vanished from it."""
    from supernode.core.config import load_stack
    from supernode.core.plan import build_local_plan
    from supernode.tools.train_local import summary

    plan = build_local_plan("dev", load_stack("dev", ROOT))
    recs = [
        {"step": 1, "loss": 3.0, "tokens_per_s": 100.0, "step_s": 9.0},  # the first step warms up
        {"step": 2, "loss": None, "skipped": True, "tokens_per_s": 100.0},
        {"step": 3, "loss": 2.5, "tokens_per_s": 100.0, "step_s": 3 * plan.step.step_s},
    ]
    (tmp_path / JSONL).write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary(tmp_path, plan)
    out = capsys.readouterr().out
    assert "loss 3.000 (step 1) -> 2.500 (step 3); 1 non-finite step(s) skipped;" in out
    # issue 29 item 4: the measured step (median, past the first) next to the plan's estimate
    assert f"vs {plan.step.step_s:.3g} s planned: x3.00 of the plan" in out


@pytest.mark.slow
def test_a_step_that_hangs_outside_any_collective_is_restarted_and_counted(tmp_path, data_dir, reap):
    """Issue 41 item 3: a hang no collective times out only raised the step-stalled alarm. Now the
    worker's heartbeat goes silent, the launcher kills it after training.stallRestartS, torchrun
    restarts it (one of --max-restarts) from the newest checkpoint, the run ends, exit 0, and the
    stall is counted (OUT/stalls.jsonl, read by the restarted trainer's gauge)."""
    plan = write_plan(
        one_rank_plan(steps=8, checkpointInterval=2, collectiveTimeoutS=10, stallRestartS=11), tmp_path / "plan.json"
    )
    out = tmp_path / "out"
    t0 = time.monotonic()
    proc = reap(cluster_launcher(plan, data_dir, out, env={"SUPERNODE_INJECT_FAULT": "stall@5"}))
    log, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, log[-3000:]
    assert time.monotonic() - t0 > 11  # it waited for the stall timeout, no sooner
    (stall,) = [json.loads(line) for line in (out / STALLS).read_text().splitlines()]
    assert stall["after"] == "step 4" and stall["timeout_s"] == 11 and stall["silent_s"] > 11
    assert "made no progress for" in log and "after step 4 (training.stallRestartS = 11)" in log
    # From the newest committed checkpoint: step 4's async save commits at step 5's poll, which the
    # hang never reached, so step 2's (a hung step cannot checkpoint; the periodic saves bound the loss).
    assert "resumed from checkpoint at step 2" in log
    assert "1 stalled worker(s) restarted" in log
    assert len(lines_matching(LogPattern.TRAINER_START, log)) == 2  # the restart alarm counts both starts
    step_4 = re.findall(r"step 4: loss (\S+);", log)
    assert len(step_4) == 2 and step_4[0] == step_4[1]  # the restart retrained step 4 to the same loss
    assert max(losses(out)) == 8
