"""The local backend of `supernode job` (issue 36, item 6): the job API on this machine, so a newcomer
sees queueing, priorities and preemption work without a cluster.

- The store is one SQLite file, HOME/jobs.db (WAL; every change one `BEGIN IMMEDIATE` transaction,
  so `submit`, `cancel` and the runner never see half a change). A job's files are HOME/jobs/NAME/:
  its job file, its plan (plan.json), its log and its run (runs/NAME/: metrics, checkpoints, run.json).
- One runner (`supernode job runner`, started by `submit` when none holds HOME/.lock) admits queued
  jobs by priority (high, normal, low; then submission order) into its slots: local processes, as
  many as the stack's local run has (`local.nproc`), each job needing its plan's world. A queued job
  that does not fit preempts running jobs of a lower priority, the lowest (then the newest) first:
  SIGTERM, on which the trainer finishes its step and checkpoints (supernode train); the runner waits
  out the plan's grace period, then SIGKILLs. A preempted job is queued again and resumes from its
  checkpoint when admitted (`supernode train --run NAME` resumes the run), to the loss an
  uninterrupted run reaches. While a preemption is under way nothing else is admitted, so the freed
  processes go to the job that asked for them.
- A job runs as `supernode train --local --job FILE --out HOME/jobs/NAME --run NAME`: the stack's
  local plan with the job's training keys; its process dies with the runner (PR_SET_PDEATHSIG), and a
  runner that starts finds the jobs a dead one ran and queues them again (they resume): a crash
  loses no job. SIGTERM/SIGINT to the runner stop its jobs the same way (checkpoint, requeue).
- `cancel` of a queued job ends it at once; of a running one asks the runner, which stops it as a
  preemption (it checkpoints) and marks it cancelled.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from supernode.core.checkpoints import complete_checkpoints
from supernode.core.config import StackConfig, from_mapping
from supernode.core.config.schema import TrainingOverride
from supernode.core.errors import EXIT_INTERRUPTED, BadInput, ConfigError
from supernode.core.jobs import FINAL_STATES, PRIORITIES, JobSpec, JobStatus, job_config
from supernode.core.layout import P
from supernode.core.observability import JSONL
from supernode.core.outdir import OutDirLock
from supernode.core.plan import Plan, build_local_plan
from supernode.core.processes import die_with_parent
from supernode.core.runs import run_dir
from supernode.trainer.data.manifest import DataError

DB = "jobs.db"
TICK_S = 0.2
SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    name TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,             -- submission order, the tie-break within a priority
    team TEXT NOT NULL,
    priority TEXT NOT NULL,
    rank INTEGER NOT NULL,            -- 0 low, 1 normal, 2 high
    state TEXT NOT NULL,
    spec TEXT NOT NULL,               -- the job file as submitted (JSON of the validated JobSpec)
    stack_args TEXT NOT NULL,         -- the flags naming its stack for `supernode train` (JSON list)
    slots INTEGER NOT NULL,           -- its plan's world: the local processes it holds
    steps INTEGER NOT NULL,
    plan_tokens_per_s REAL,
    grace_s REAL NOT NULL,
    submitted_at REAL NOT NULL,
    queued_at REAL NOT NULL,          -- submitted or last requeued: where its current wait began
    admitted_at REAL,
    finished_at REAL,
    waited_s REAL,                    -- its last wait, queued -> admitted
    attempts INTEGER NOT NULL DEFAULT 0,
    preemptions INTEGER NOT NULL DEFAULT 0,
    pid INTEGER,
    exit_code INTEGER,
    step INTEGER,
    loss REAL,
    tokens_per_s REAL,
    last_checkpoint INTEGER,
    message TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs (state, rank, seq);
"""
ACTIVE = ("running", "preempting", "cancelling")


def local_job_config(cfg: StackConfig, job: JobSpec, source: str = "") -> StackConfig:
    """The stack as the job's local run has it: the job's model, parallel, node and image keys validated
    against the stack's hardware (`job_config`: the cluster's rules), its training keys applied over
    the local run's (a local job's steps and intervals are the local run's scale, not the cluster's)."""
    data = job_config(cfg, job.model_copy(update={"training": TrainingOverride()}), source).to_mapping()
    data["local"]["training"].update(job.training.model_dump(by_alias=True, exclude_none=True))
    try:
        return from_mapping(data, source)
    except ConfigError as e:  # the local run's training keys are the job file's `training` ones
        local = f"{P}local.training."
        issues = [i.model_copy(update={"path": i.path.replace(local, "training.")}) for i in e.issues]
        raise ConfigError(issues, source) from None


def local_job_plan(stack: str, cfg: StackConfig, job: JobSpec, nproc: int | None = None) -> Plan:
    if job.branch is not None:
        raise BadInput(
            "branch: a local job starts its own run; branch another run locally with "
            "`supernode train --local --from-run R --step N`, or submit the job to the cluster"
        )
    return build_local_plan(stack, local_job_config(cfg, job, f"job {job.name}"), nproc)


def job_dir(home: Path, name: str) -> Path:
    return home / "jobs" / name


@dataclass
class Child:
    """A job the runner started: its process, and when it was asked to stop."""

    proc: subprocess.Popen
    log: object
    stop_sent_at: float | None = None
    killed: bool = False
    by: str = ""  # who asked it to stop: the preempting job, "cancel", "runner stopping"


@dataclass
class LocalBackend:
    home: Path
    slots: int | None = None  # the runner's processes (default: the biggest job's world, local.nproc)
    start_runner: bool = True  # submit starts a runner when none holds the queue (tests drive tick() instead)
    children: dict[str, Child] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.home = Path(self.home)

    # -- the store ---------------------------------------------------------------------------------

    @contextmanager
    def db(self, write: bool = False) -> Iterator[sqlite3.Connection]:
        self.home.mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(self.home / DB, timeout=30, isolation_level=None)
        con.row_factory = sqlite3.Row
        try:
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("PRAGMA busy_timeout=30000")
            con.executescript(SCHEMA)
            con.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")
        except sqlite3.OperationalError as e:  # locked past the timeout, or the disk is full: nothing is lost
            raise BadInput(f"{self.home / DB}: {e}; nothing was changed, try again") from None
        except sqlite3.DatabaseError as e:
            raise BadInput(
                f"{self.home / DB}: not a usable job store ({e}); move it away to start an empty one"
            ) from None
        finally:
            con.close()

    def _row(self, con: sqlite3.Connection, name: str) -> sqlite3.Row:
        row = con.execute("SELECT * FROM jobs WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise BadInput(f"no job {name!r} in the local queue {self.home} (`supernode job list --local`)")
        return row

    # -- the API -----------------------------------------------------------------------------------

    def submit(self, job: JobSpec, plan: Plan, job_file: Path, stack_args: list[str]) -> JobStatus:
        spec = job.model_dump_json(by_alias=True, exclude_defaults=True)
        now = time.time()
        with self.db(write=True) as con:
            old = con.execute("SELECT * FROM jobs WHERE name = ?", (job.name,)).fetchone()
            if old is not None:
                if old["spec"] != spec:
                    raise BadInput(
                        f"job {job.name!r} is already in the local queue ({old['state']}) with another job file; "
                        "give this one another name, or cancel that one"
                    )
                status = self._status(con, old, now)
                status.message = f"already submitted: {status.message}".rstrip(": ")
                return status
            seq = con.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs").fetchone()[0]
            where = job_dir(self.home, job.name)
            where.mkdir(parents=True, exist_ok=True)
            (where / "job.yaml").write_text(yaml.safe_dump(json.loads(spec), sort_keys=False), encoding="utf-8")
            (where / "plan.json").write_text(plan.to_json(), encoding="utf-8")
            con.execute(
                "INSERT INTO jobs (name, seq, team, priority, rank, state, spec, stack_args, slots, steps, "
                "plan_tokens_per_s, grace_s, submitted_at, queued_at, message) "
                "VALUES (?, ?, ?, ?, ?, 'queued', ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    job.name, seq, job.team, job.priority, PRIORITIES.index(job.priority), spec,
                    json.dumps(stack_args), plan.world_size, plan.training.steps, plan.layout.tokens_per_s,
                    float(plan.termination_grace_s), now, now, f"queued from {job_file}",
                ),
            )  # fmt: skip
            row = self._row(con, job.name)
            status = self._status(con, row, now)
        started = self.start_runner and self.ensure_runner()
        status.message = "queued; " + ("started the local runner" if started else "the local runner admits it")
        return status

    def list(self, team: str | None = None) -> list[JobStatus]:
        now = time.time()
        with self.db() as con:
            rows = con.execute(
                "SELECT * FROM jobs" + (" WHERE team = ?" if team else "") + " ORDER BY seq", (team,) if team else ()
            ).fetchall()
            positions = self._positions(con)
        return [self._status(None, r, now, positions) for r in rows]

    def describe(self, name: str, team: str | None = None) -> JobStatus:
        with self.db() as con:
            return self._status(con, self._row(con, name), time.time())

    def logs(self, name: str, team: str | None = None, follow: bool = False) -> Iterator[str]:
        self.describe(name)  # a clear error for an unknown job
        path = job_dir(self.home, name) / "log"
        while not path.exists():  # queued, never started: nothing to show yet
            if not follow or self.describe(name).state in FINAL_STATES:
                return
            time.sleep(TICK_S)
        with path.open(encoding="utf-8", errors="replace") as f:
            while True:
                line = f.readline()
                if line:
                    yield line
                    continue
                if not follow or self.describe(name).state in FINAL_STATES:
                    yield from f  # what the last moment wrote
                    return
                time.sleep(TICK_S)

    def cancel(self, name: str, team: str | None = None) -> JobStatus:
        now = time.time()
        with self.db(write=True) as con:
            row = self._row(con, name)
            if row["state"] in FINAL_STATES:
                raise BadInput(f"job {name!r} has already ended ({row['state']}); nothing to cancel")
            if row["state"] == "queued":
                con.execute(
                    "UPDATE jobs SET state = 'cancelled', finished_at = ?, message = ? WHERE name = ?",
                    (now, "cancelled while queued", name),
                )
            else:  # the runner stops it (a checkpoint first) and marks it cancelled
                con.execute(
                    "UPDATE jobs SET state = 'cancelling', message = ? WHERE name = ?",
                    ("cancelling: it checkpoints, then stops", name),
                )
            return self._status(con, self._row(con, name), now)

    # -- status ------------------------------------------------------------------------------------

    @staticmethod
    def _positions(con: sqlite3.Connection) -> dict[str, int]:
        rows = con.execute("SELECT name FROM jobs WHERE state = 'queued' ORDER BY rank DESC, seq").fetchall()
        return {r["name"]: i + 1 for i, r in enumerate(rows)}

    def _status(
        self, con: sqlite3.Connection | None, row: sqlite3.Row, now: float, positions: dict[str, int] | None = None
    ) -> JobStatus:
        if positions is None:
            positions = self._positions(con) if con is not None else {}
        state = row["state"]
        step, loss, tps, ckpt = row["step"], row["loss"], row["tokens_per_s"], row["last_checkpoint"]
        if state in ACTIVE:  # the run moves on: read its newest record and checkpoint
            step, loss, tps, ckpt = _progress(self.home, row["name"], (step, loss, tps, ckpt))
        return JobStatus(
            name=row["name"],
            team=row["team"],
            priority=row["priority"],
            state=state,
            backend="local",
            submitted_at=row["submitted_at"],
            queue_position=positions.get(row["name"]),
            waited_s=now - row["queued_at"] if state == "queued" else row["waited_s"],
            nodes=row["slots"] if state in ACTIVE else 0,
            steps=row["steps"],
            step=step,
            loss=loss,
            tokens_per_s=tps,
            plan_tokens_per_s=row["plan_tokens_per_s"],
            last_checkpoint=ckpt,
            run=row["name"] if row["attempts"] else None,  # a local job's run is named after it (no branching)
            preemptions=row["preemptions"],
            attempts=row["attempts"],
            exit_code=row["exit_code"],
            message=row["message"],
        )

    # -- the runner --------------------------------------------------------------------------------

    def ensure_runner(self) -> bool:
        """Start a runner unless one holds the queue; True when this call started one."""
        probe = OutDirLock(self.home)
        if probe.acquire() is not None:
            return False
        probe.release()
        log = (self.home / "runner.log").open("ab")
        subprocess.Popen(
            [sys.executable, "-m", "supernode", "job", "runner", "--home", str(self.home.resolve())],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # outlives the submit; its jobs die with it (and are requeued by the next)
        )
        log.close()
        return True

    def run_runner(self, linger_s: float = 2.0) -> int:
        lock = OutDirLock(self.home)
        if lock.acquire() is not None:
            return 0  # another runner holds the queue: it admits this one's jobs
        stopping: list[int] = []
        previous = {
            s: signal.signal(s, lambda signum, frame: stopping.append(signum)) for s in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            self._recover()
            idle_since = None
            while True:
                busy = self.tick(stopping=bool(stopping))
                if busy:
                    idle_since = None
                elif stopping:
                    return EXIT_INTERRUPTED
                else:
                    idle_since = idle_since or time.monotonic()
                    if time.monotonic() - idle_since >= linger_s:
                        lock.release()  # then look once more: a submit that saw the lock held relies on us
                        if not self._queued() or lock.acquire() is not None:
                            return 0
                        idle_since = None
                time.sleep(TICK_S)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            lock.release()

    def _queued(self) -> bool:
        with self.db() as con:
            return con.execute("SELECT 1 FROM jobs WHERE state = 'queued' LIMIT 1").fetchone() is not None

    def _recover(self) -> None:
        """A runner before this one died with jobs under way: their processes died with it; kill any
        that lingers (it holds the job's out directory), and queue the jobs again (they resume)."""
        now = time.time()
        with self.db(write=True) as con:
            for row in con.execute("SELECT * FROM jobs WHERE state IN (?, ?, ?)", ACTIVE).fetchall():
                _free_out_dir(job_dir(self.home, row["name"]))
                step, loss, tps, ckpt = _progress(self.home, row["name"], (row["step"], None, None, None))
                if row["state"] == "cancelling":
                    state, message, finished = "cancelled", "cancelled (its runner stopped first)", now
                else:
                    at = f"from the step-{ckpt} checkpoint" if ckpt else "from the start"
                    state, message, finished = (
                        "queued",
                        f"requeued: its runner stopped while it ran; resumes {at}",
                        None,
                    )
                con.execute(
                    "UPDATE jobs SET state = ?, message = ?, finished_at = ?, queued_at = ?, pid = NULL, step = ?, "
                    "loss = ?, tokens_per_s = ?, last_checkpoint = ? WHERE name = ?",
                    (state, message, finished, now, step, loss, tps, ckpt, row["name"]),
                )

    def tick(self, stopping: bool = False) -> bool:
        """One round: reap, stop what must stop, admit. True while a job is queued or running."""
        self._reap()
        with self.db(write=True) as con:
            rows = con.execute("SELECT * FROM jobs WHERE state NOT IN (?, ?, ?)", FINAL_STATES).fetchall()
            for row in rows:
                if row["state"] == "cancelling":
                    self._stop(row["name"], "cancel")
                if stopping and row["state"] in ACTIVE:
                    self._stop(row["name"], "the runner stopping")
            if not stopping:
                self._admit(con, rows)
        self._enforce_grace(rows)
        return bool(rows) or bool(self.children)

    def _admit(self, con: sqlite3.Connection, rows: list[sqlite3.Row]) -> None:
        capacity = (self.slots or max(r["slots"] for r in rows)) if rows else 0
        running = [r for r in rows if r["state"] in ACTIVE]
        free = capacity - sum(r["slots"] for r in running)
        freeing = sum(r["slots"] for r in running if r["state"] != "running")  # stopping: their slots are spoken for
        queued = sorted((r for r in rows if r["state"] == "queued"), key=lambda r: (-r["rank"], r["seq"]))
        for row in queued:
            if row["slots"] > capacity:
                self._end(con, row["name"], "failed", f"needs {row['slots']} processes; the runner has {capacity}")
                continue
            if row["slots"] <= free:
                self._start(con, row)
                free -= row["slots"]
                continue
            # Lower-priority jobs it may preempt: the lowest priority first, then the newest.
            victims = sorted(
                (r for r in running if r["rank"] < row["rank"] and r["state"] == "running"),
                key=lambda r: (r["rank"], -r["seq"]),
            )
            need = row["slots"] - free - freeing
            chosen = []
            for v in victims:
                if need <= 0:
                    break
                chosen.append(v)
                need -= v["slots"]
            if need <= 0:
                for v in chosen:
                    con.execute(
                        "UPDATE jobs SET state = 'preempting', message = ? WHERE name = ?",
                        (
                            f"preempted by {row['name']} ({row['priority']}): checkpointing, then queued again",
                            v["name"],
                        ),
                    )
                    self._stop(v["name"], row["name"])
                return  # nothing else is admitted while processes are freed for this job

    def _start(self, con: sqlite3.Connection, row: sqlite3.Row) -> None:
        name = row["name"]
        where = job_dir(self.home, name)
        data = self.home / "data"
        attempt = row["attempts"] + 1
        command = [
            sys.executable, "-m", "supernode", "train", *json.loads(row["stack_args"]), "--local",
            "--job", str(where / "job.yaml"), "--out", str(where), "--data", str(data), "--run", name,
        ]  # fmt: skip
        try:  # a full disk or a removed job directory fails this job, not the runner and its other jobs
            _prepare_data(data)
            log = (where / "log").open("a", encoding="utf-8")
            log.write(f"== attempt {attempt}: admitted at {time.strftime('%H:%M:%S')} ==\n")
            log.flush()
            proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
            )
        except (OSError, DataError) as e:
            self._end(con, name, "failed", f"could not start: {e}")
            return
        self.children[name] = Child(proc, log)
        now = time.time()
        con.execute(
            "UPDATE jobs SET state = 'running', attempts = ?, admitted_at = ?, waited_s = ?, pid = ?, message = ? "
            "WHERE name = ?",
            (attempt, now, now - row["queued_at"], proc.pid, f"running (attempt {attempt})", name),
        )

    def _stop(self, name: str, by: str) -> None:
        child = self.children.get(name)
        if child is not None and child.stop_sent_at is None:
            child.proc.send_signal(signal.SIGTERM)  # `supernode train` forwards it: a step, a checkpoint, exit
            child.stop_sent_at, child.by = time.monotonic(), by

    def _enforce_grace(self, rows: list[sqlite3.Row]) -> None:
        grace = {r["name"]: r["grace_s"] for r in rows}
        for name, child in self.children.items():
            if child.stop_sent_at and not child.killed and time.monotonic() - child.stop_sent_at > grace.get(name, 0):
                child.proc.kill()
                child.killed = True

    def _reap(self) -> None:
        for name, child in list(self.children.items()):
            rc = child.proc.poll()
            if rc is None:
                continue
            del self.children[name]
            child.log.close()
            with self.db(write=True) as con:
                row = self._row(con, name)
                step, loss, tps, ckpt = _progress(self.home, name, (None, None, None, None))
                state, message = _outcome(row, child, rc, step, ckpt)
                con.execute(
                    "UPDATE jobs SET state = ?, message = ?, exit_code = ?, pid = NULL, step = ?, loss = ?, "
                    "tokens_per_s = ?, last_checkpoint = ?, finished_at = ?, queued_at = ?, "
                    "preemptions = preemptions + ? WHERE name = ?",
                    (
                        state, message, rc, step, loss, tps, ckpt,
                        time.time() if state in FINAL_STATES else None, time.time(),
                        1 if row["state"] == "preempting" else 0, name,
                    ),
                )  # fmt: skip

    def _end(self, con: sqlite3.Connection, name: str, state: str, message: str) -> None:
        con.execute(
            "UPDATE jobs SET state = ?, message = ?, finished_at = ? WHERE name = ?",
            (state, message, time.time(), name),
        )


def _outcome(row: sqlite3.Row, child: Child, rc: int, step: int | None, ckpt: int | None) -> tuple[str, str]:
    """Where an ended process leaves its job: (state, message)."""
    late = " (killed: it did not stop within its grace period)" if child.killed else ""
    if row["state"] == "cancelling":
        return "cancelled", f"cancelled at step {step}{late}"
    if ckpt is not None and ckpt >= row["steps"] and rc in (0, EXIT_INTERRUPTED):  # done as it was asked to stop
        return "succeeded", f"finished step {ckpt}"
    if row["state"] == "preempting" or child.by or rc == EXIT_INTERRUPTED:  # it checkpointed: run it again
        at = f"the step-{ckpt} checkpoint" if ckpt else "the start"
        why = f"preempted by {child.by}" if row["state"] == "preempting" else f"stopped by {child.by or 'a signal'}"
        return "queued", f"{why} at step {step}{late}; queued again, resumes from {at}"
    if rc == 0:
        return "succeeded", f"finished step {step}"
    return "failed", f"exit {rc} at step {step} (see `supernode job logs --local {row['name']}`)"


def _progress(home: Path, name: str, known: tuple) -> tuple:
    """(step, loss, tokens/s, newest complete checkpoint step) of the job's run; `known` where none."""
    run = run_dir(job_dir(home, name), name)
    step, loss, tps, ckpt = known
    last = _last_record(run / JSONL)
    if last is not None:
        step, loss, tps = last.get("step", step), last.get("loss", loss), last.get("tokens_per_s", tps)
    done = complete_checkpoints(run / "checkpoints") if (run / "checkpoints").is_dir() else []
    ckpt = done[-1][0] if done else ckpt
    # A run stopped between two logged steps checkpointed a step its metrics do not have.
    return max(step or 0, ckpt or 0) or step, loss, tps, ckpt


def _last_record(path: Path, tail: int = 8192) -> dict | None:
    """The newest metrics record with a loss, from the file's last few KiB (a long run's file is not
    read whole for a status line); a torn last line is skipped."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and isinstance(rec.get("loss"), (int, float)):
            return rec
    return None


def _prepare_data(data: Path) -> None:
    """The shipped corpus, tokenized once for every local job (HOME/data)."""
    if (data / "manifest.json").exists():
        return
    from supernode.trainer.data.prepare import DEFAULT_CORPUS, prepare

    prepare(DEFAULT_CORPUS, data, shard_tokens=1 << 16)


def _free_out_dir(where: Path) -> None:
    """Kill the process that still holds the job's out directory (its `supernode train`, whose launcher
    and workers die with it), if any: the lock is held only while one runs, so a recorded pid of an
    ended run (perhaps reused since) is never signalled."""
    lock = OutDirLock(where)
    if lock.acquire() is None:
        lock.release()
        return
    pid, _ = OutDirLock.holder_pid(where)
    if pid is not None:
        _kill_and_wait(pid)


def _kill_and_wait(pid: int, timeout_s: float = 10.0) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
