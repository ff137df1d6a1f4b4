"""metrics.prom ends on the run's last checkpoint, the expert-load plot marks the top-k ceiling, and
memory by term is measured beside the plan's figures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from ranks import logged

from supernode.core.config import load_stack
from supernode.core.plan import build_local_plan
from supernode.trainer.checkpoint import Checkpointer
from supernode.trainer.metrics import LOAD_PNG, PROM, Metrics, expert_load_figure, load_ceiling, load_imbalance

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plan():
    return build_local_plan("dev", load_stack("dev", ROOT))


def log(m: Metrics, step: int, load: torch.Tensor | None = None) -> None:
    m.log(step, 4.0, 1e-3, 0.5, 2048, 0.5, 0.3, 0.15, 0.05, load)


def prom_checkpoint_step(out: Path) -> float:
    families = {f.name: f for f in text_string_to_metric_families((out / PROM).read_text())}
    return families["supernode_train_last_checkpoint_step"].samples[0].value


def test_metrics_prom_ends_on_the_last_save(tmp_path, plan, group):
    """The trainer logs a step, then saves it (train.py): the file written with the log still shows
    the checkpoint before; closing the metrics must bring it to the last save."""
    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, keep=2, state={"model": torch.nn.Linear(4, 4)}, async_save=True)
    m = Metrics(tmp_path, plan, world_size=1, device_type="cpu", checkpoints=root)
    log(m, 1)
    ckpt.save(1, sync=True)
    log(m, 2)  # the last step: logged, then saved
    ckpt.save(2, sync=True)
    assert prom_checkpoint_step(tmp_path) == 1
    ckpt.close()
    m.close()
    assert prom_checkpoint_step(tmp_path) == 2


def test_the_expert_load_plot_marks_the_top_k_ceiling(tmp_path, plan):
    experts, top_k = plan.model.experts, plan.model.top_k
    assert top_k > 1  # else the ceiling is the expert count and the test tells nothing
    ceiling = load_ceiling(experts, top_k)
    assert ceiling == experts / top_k
    # every token routed to the same top_k experts reaches the ceiling, never more
    collapsed = torch.zeros(1, experts)
    collapsed[0, :top_k] = 100
    assert load_imbalance(collapsed) == [ceiling]

    recs = [{"step": s, "expert_load_max_over_mean": [1.2, 1.5]} for s in (1, 2, 3)]
    fig = expert_load_figure(recs, ceiling)
    ax = fig.axes[0]
    flat = {line.get_label(): set(line.get_ydata()) for line in ax.get_lines()}
    marked = [label for label, ys in flat.items() if ys == {ceiling}]
    assert marked and "top-k ceiling" in marked[0], flat
    assert any(t.get_text() == marked[0] for t in ax.get_legend().get_texts())
    import matplotlib.pyplot as plt

    plt.close(fig)

    m = Metrics(tmp_path, plan, world_size=1, device_type="cpu")
    log(m, 1, torch.tensor([[10, 2, 2, 2]]))
    m.close(plots=True)
    assert (tmp_path / LOAD_PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_by_term_is_measured_beside_the_plan(tmp_path, plan):
    from supernode.trainer.memory import measured_terms, planned_terms

    model = torch.nn.Linear(64, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    optimizer.step()
    measured = measured_terms(model, optimizer, torch.device("cpu"))
    numel = 64 * 32 + 32
    assert measured["parameters"] == 4 * numel and measured["optimizer_state"] == 8 * numel  # fp32, two moments
    assert measured["peak"] > measured["parameters"]  # the process's peak resident memory holds them all
    planned = planned_terms(plan)
    assert planned["parameters"] == plan.memory.parameters
    assert planned["peak"] == plan.memory.total - plan.memory.runtime_reserve

    m = Metrics(tmp_path, plan, world_size=1, device_type="cpu")
    with logged() as said:
        m.memory(measured, planned)
    log(m, 1)
    families = {f.name: f for f in text_string_to_metric_families((tmp_path / PROM).read_text())}
    got = {s.labels["term"]: s.value for s in families["supernode_train_memory_bytes"].samples}
    want = {s.labels["term"]: s.value for s in families["supernode_train_plan_memory_bytes"].samples}
    assert got == measured and want == planned
    assert said and said[0].startswith("memory per rank, measured / plan: parameters 0.0 / ")
