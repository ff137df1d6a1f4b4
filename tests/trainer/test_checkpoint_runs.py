"""Run identities (issue 28 item 5): OUT/runs/<run id>/ with its run.json, the latest run resumed by
default, a named or fresh run, a branch from another run's step, a legacy OUT/checkpoints migrated,
and every refusal one BadInput naming the flag and its value. The selection itself runs without a
process group; the slow tests train for real through the trainer and `supernode train`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_failures import one_rank_plan, trainer_alone
from test_train import ROOT, write_plan

from supernode.cli import main as cli
from supernode.core import runs
from supernode.core.checkpoints import COMPLETE
from supernode.core.config import load_stack
from supernode.core.errors import BadInput
from supernode.core.plan import build_local_plan
from supernode.core.runs import prepare_run
from supernode.trainer.data.prepare import DEFAULT_CORPUS, prepare

MODEL = {"dim": 64, "heads": 4, "top_k": 2}
OTHER = {"dim": 64, "heads": 4, "top_k": 1}


def committed(checkpoints: Path, step: int, model: dict = MODEL) -> Path:
    """A step directory as the checkpointer commits it (only its marker matters to the selection)."""
    d = checkpoints / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / COMPLETE).write_text(json.dumps({"step": step, "files": {}, "model": model}), encoding="utf-8")
    return d


def pick(out: Path, model: dict = MODEL, **kw):
    return prepare_run(out, "dev", model, say=lambda line: None, **kw)


def test_a_fresh_out_gets_a_new_run_with_its_identity_written_once(tmp_path):
    choice = pick(tmp_path)
    assert choice.how == "new" and choice.dir == tmp_path / "runs" / choice.run
    rec = json.loads((choice.dir / "run.json").read_text())
    assert rec["stack"] == "dev" and rec["run"] == choice.run and rec["parent"] is None
    assert rec["model_fingerprint"] == runs.model_fingerprint(MODEL) and rec["model"] == MODEL
    assert runs.model_fingerprint(MODEL) != runs.model_fingerprint(OTHER)
    with pytest.raises(FileExistsError):  # run.json is never rewritten
        runs.write_record(choice.dir, {**rec, "stack": "prod"})
    assert json.loads((choice.dir / "run.json").read_text()) == rec
    assert not list(choice.dir.glob(".run.json.*"))  # no temporary left


@pytest.mark.parametrize(
    "edit,problem",
    [
        (lambda rec: "{torn", "not JSON"),
        (lambda rec: [rec], "not a JSON object but list"),
        (lambda rec: {**rec, "created_ns": "soon"}, "created_ns 'soon': expected int"),
        (lambda rec: {k: v for k, v in rec.items() if k != "model_fingerprint"}, "no model_fingerprint"),
        (lambda rec: {**rec, "parent": {"run": "../../elsewhere", "step": 2}}, "parent {'run': '../../elsewhere'"),
        (lambda rec: {**rec, "parent": {"run": "base"}}, "parent {'run': 'base'} is not"),
        (lambda rec: {**rec, "parent": {"run": "base", "step": True}}, "parent {'run': 'base', 'step': True}"),
    ],
)
def test_a_run_json_that_is_not_a_run_record_is_bad_input_naming_it(tmp_path, edit, problem):
    """Issue 41 (hostile run.json): a hand-edited record is refused, naming the file and what is wrong,
    before its creation time is sorted or its parent followed to a directory (it was a TypeError, a
    KeyError, or a parent outside OUT/runs); before, a torn one was skipped, and the next start
    resumed an older run as "the latest"."""
    pick(tmp_path, run="base")
    liar = pick(tmp_path, run="liar")
    path = liar.dir / runs.RUN_FILE
    edited = edit(json.loads(path.read_text()))
    path.write_text(edited if isinstance(edited, str) else json.dumps(edited))
    for kw in ({}, {"run": "base"}, {"run": "liar"}):
        with pytest.raises(BadInput) as e:
            pick(tmp_path, **kw)
        assert f"{path}: not a run record (" in str(e.value) and problem in str(e.value), str(e.value)
    assert path.read_text() == (edited if isinstance(edited, str) else json.dumps(edited))  # nothing rewritten


def test_the_latest_run_is_resumed_by_default_and_a_name_picks_another(tmp_path):
    first = pick(tmp_path, run="first")
    committed(first.checkpoints, 2)
    second = pick(tmp_path, run="second")
    assert second.how == "new"
    again = pick(tmp_path)
    assert (again.run, again.how) == ("second", "new")  # the latest: created last, no checkpoint yet
    committed(second.checkpoints, 4)
    assert (pick(tmp_path).run, pick(tmp_path).how) == ("second", "resumed")
    assert (pick(tmp_path, run="first").run, pick(tmp_path, run="first").how) == ("first", "resumed")


def test_a_branch_starts_from_the_parents_step_and_a_restart_resumes_it(tmp_path):
    parent = pick(tmp_path, run="base")
    step2 = committed(parent.checkpoints, 2)
    committed(parent.checkpoints, 4)
    branch = pick(tmp_path, run="lr-low", from_run="base", step=2)
    assert branch.how == "branched" and branch.parent_step == step2
    assert json.loads((branch.dir / "run.json").read_text())["parent"] == {"run": "base", "step": 2}
    again = pick(tmp_path, run="lr-low", from_run="base", step=2)  # torchrun restarts with the same flags
    assert again.run == "lr-low" and again.parent_step == step2
    committed(branch.checkpoints, 3)
    resumed = pick(tmp_path, run="lr-low")
    assert resumed.how == "resumed" and resumed.parent_step is None  # its own checkpoint wins now


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"step": 2}, "--step 2 goes with --from-run"),
        ({"from_run": "base"}, "--from-run base needs --step N"),
        ({"run": "x", "from_run": "nope", "step": 2}, "--from-run nope: no such run in"),
        ({"run": "x", "from_run": "base", "step": 3}, "--step 3: run base has no complete checkpoint of step 3"),
        ({"from_run": "base", "step": 2}, "--from-run base needs --run NAME"),
        ({"run": "base", "from_run": "base", "step": 2}, "--run base: run base (stack dev, model "),
        ({"run": "../up"}, "--run '../up': not a run name"),
        ({"run": "new"}, "--run 'new': not a run name"),
        ({"run": "x", "from_run": "base", "step": 0}, "--step 0: a checkpoint's step is at least 1"),
    ],
)
def test_bad_run_flags_are_one_bad_input_naming_the_flag(tmp_path, kw, message):
    base = pick(tmp_path, run="base")
    committed(base.checkpoints, 2)
    with pytest.raises(BadInput) as e:
        pick(tmp_path, **kw)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert sorted(runs.runs(tmp_path)) == ["base"]  # a refusal creates no run


def test_a_run_of_another_model_is_refused_naming_keys_and_fingerprints(tmp_path):
    base = pick(tmp_path, run="base")
    committed(base.checkpoints, 2)
    ours, theirs = runs.model_fingerprint(OTHER), runs.model_fingerprint(MODEL)
    with pytest.raises(BadInput) as e:
        pick(tmp_path, OTHER, run="x", from_run="base", step=2)
    assert str(e.value).startswith("--from-run base: run base was written for another model (model.top_k 2 -> 1)")
    assert f"model fingerprint {theirs} -> {ours}" in str(e.value)
    with pytest.raises(BadInput, match=r"^run base \(the latest in .*\) was written for another model \(model.top_k"):
        pick(tmp_path, OTHER)
    assert sorted(runs.runs(tmp_path)) == ["base"]


def test_a_legacy_out_checkpoints_becomes_the_run_that_resumes_it(tmp_path):
    legacy = tmp_path / "checkpoints"
    committed(legacy, 40)
    said: list[str] = []
    choice = prepare_run(tmp_path, "dev", MODEL, run="old", say=said.append)
    assert (choice.run, choice.how) == ("old", "resumed")
    assert (choice.checkpoints / "step_00000040" / COMPLETE).is_file() and not legacy.exists()
    rec = json.loads((choice.dir / "run.json").read_text())
    assert rec["migrated_from"] == str(legacy) and rec["model_fingerprint"] == runs.model_fingerprint(MODEL)
    assert said == [f"{legacy} (written before run identities) is now run old: {choice.checkpoints}"]
    # without a name it becomes the latest run, resumed; its marker's model is what it is judged by
    other = tmp_path / "other"
    committed(other / "checkpoints", 8, model=OTHER)
    with pytest.raises(BadInput, match=r"was written for another model \(model.top_k 1 -> 2\)"):
        pick(other)
    assert [r["model"] for r in runs.runs(other).values()] == [OTHER]  # migrated all the same, once


# -- for real ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokens")
    prepare(DEFAULT_CORPUS, out, shard_tokens=1 << 16)
    return out


def losses(run: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if isinstance(r.get("loss"), float)}


@pytest.mark.slow
def test_a_branch_continues_the_parents_state_and_another_model_is_refused(tmp_path, data_dir):
    """Run base trains steps 1-4; run branch starts from base's step 2 and trains 3-4: the same
    losses as base's 3-4 (weights, Adam moments, schedule and data position all came along). A plan
    of another model branching from base: exit 2 naming the differing key and both fingerprints."""
    out, plan = tmp_path / "out", write_plan(one_rank_plan(steps=4, checkpointInterval=2), tmp_path / "a.json")
    base = trainer_alone(plan, data_dir, out, "--sync-checkpoint", "--run-id", "base")
    assert base.returncode == 0, base.stdout[-2000:] + base.stderr[-2000:]
    branch = trainer_alone(plan, data_dir, out, "--run-id", "branch", "--from-run", "base", "--step", "2")
    assert branch.returncode == 0, branch.stdout[-2000:] + branch.stderr[-2000:]
    assert "branched run branch (stack dev, model " in branch.stdout
    assert "resumed from checkpoint at step 2" in branch.stdout
    # each run its own metrics: the branch's steps 3-4 leave the parent's records alone
    first, second = losses(out / "runs" / "base"), losses(out / "runs" / "branch")
    assert sorted(first) == [1, 2, 3, 4] and sorted(second) == [3, 4]
    assert [second[3], second[4]] == pytest.approx([first[3], first[4]], rel=1e-5)
    assert sorted(p.name for p in (out / "runs" / "branch" / "checkpoints").iterdir()) == ["step_00000004"]

    other = one_rank_plan(model={"topK": 1}, steps=4)
    r = trainer_alone(write_plan(other, tmp_path / "b.json"), data_dir, out, "--run-id", "c", "--from-run", "base")
    assert r.returncode == 2 and "--from-run base needs --step N" in r.stderr
    r = trainer_alone(
        write_plan(other, tmp_path / "b.json"), data_dir, out, "--run-id", "c", "--from-run", "base", "--step", "2"
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    theirs, ours = (runs.model_fingerprint(p.model.model_dump(mode="json")) for p in (one_rank_plan(), other))
    assert "--from-run base: run base was written for another model (model.top_k 2 -> 1)" in r.stderr
    assert f"model fingerprint {theirs} -> {ours}" in r.stderr
    assert sorted(runs.runs(out)) == ["base", "branch"]  # no run c


@pytest.mark.slow
def test_supernode_train_run_new_and_from_run_through_the_cli(tmp_path, capsys):
    out = tmp_path / "out"
    base = ["train", "--stack", "dev", "--root", str(ROOT), "--local", "--out", str(out), "--log-every", "1"]
    assert cli([*base, "--steps", "2"]) == 0
    (first,) = runs.runs(out)
    assert cli([*base, "--steps", "3"]) == 0  # the latest run, resumed
    assert list(runs.runs(out)) == [first]
    assert cli([*base, "--steps", "3", "--run", "new"]) == 0
    fresh = next(r for r in runs.runs(out) if r != first)
    assert runs.runs(out)[fresh]["parent"] is None
    capsys.readouterr()
    assert cli([*base, "--steps", "4", "--from-run", first, "--step", "3"]) == 0
    branch = next(r for r, rec in runs.runs(out).items() if rec["parent"])
    assert runs.runs(out)[branch]["parent"] == {"run": first, "step": 3}
    assert cli([*base, "--steps", "9", "--run", first, "--from-run", first, "--step", "3"]) == 2
    assert f"--run {first}: run {first} (stack dev, model " in capsys.readouterr().err
    assert cli([*base, "--steps", "2", "--run", first]) == 2  # already at step 3
    assert f"--steps 2: run {first} in {out} is already at step 3" in capsys.readouterr().err


def test_a_migration_interrupted_after_its_run_json_completes_into_the_same_run(tmp_path):
    committed(tmp_path / "checkpoints", 40)
    d = runs.run_dir(tmp_path, "half")  # the crash came between run.json and the rename
    runs.write_record(d, runs.record("dev", "half", MODEL, migrated_from=str(tmp_path / "checkpoints")))
    choice = pick(tmp_path)
    assert (choice.run, choice.how) == ("half", "resumed") and sorted(runs.runs(tmp_path)) == ["half"]
    assert (choice.checkpoints / "step_00000040" / COMPLETE).is_file()


def test_export_and_the_helpers_find_the_latest_runs_checkpoints(tmp_path):
    from supernode.trainer.hf.export import resolve_checkpoint

    assert runs.checkpoints_of(tmp_path) == tmp_path / "checkpoints"  # no run yet: the old layout's place
    old = pick(tmp_path, run="old")
    committed(old.checkpoints, 8)
    new = pick(tmp_path, run="new-one")
    committed(new.checkpoints, 2)
    newest = committed(new.checkpoints, 4)
    assert runs.run_of(tmp_path) == new.dir and runs.checkpoints_of(tmp_path, "old") == old.checkpoints
    assert resolve_checkpoint(tmp_path) == newest  # `supernode export --checkpoint OUT`


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--step", "2"], "error: --step 2 goes with --from-run"),
        (["--from-run", "nope", "--step", "2"], "error: --from-run nope: no such run in"),
        (["--from-run", "base", "--step", "3"], "error: --step 3: run base has no complete checkpoint of step 3"),
        (["--run", "a b"], "error: --run 'a b': not a run name"),
        (["--run", "base", "--from-run", "base", "--step", "2"], "error: --run base: run base (stack dev, model "),
    ],
)
def test_supernode_train_refuses_bad_run_flags_before_it_starts(tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    model = build_local_plan("dev", load_stack("dev", ROOT)).model.model_dump(mode="json")  # what the CLI trains
    base = pick(out, model, run="base")
    committed(base.checkpoints, 2, model)
    argv = ["train", "--stack", "dev", "--root", str(ROOT), "--local", "--out", str(out), "--steps", "4", *flags]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1 and "Traceback" not in err
    assert sorted(runs.runs(out)) == ["base"] and not (out / "plan.json").exists()
