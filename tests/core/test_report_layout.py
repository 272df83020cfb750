"""The report's layout: arm order, labels that fit, the best-of-N note, curves from training returns."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import mlflow
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from core.report import analyze
from core.report.data import OK, TRAIN_RETURN, StudyRun, assign_arms, load_study
from core.report.render import (
    LABEL_LINES,
    LABEL_WIDTH,
    _final_figure,
    _improvement_figure,
    render_figures,
    render_markdown,
    short_label,
)
from core.report.study import arm_order


def _run(
    arm: str, seed: int, fitness: float, start: int, candidates: float = 1.0, curve=None, train_curve=None
) -> StudyRun:
    run = StudyRun(
        f"{arm}{seed}",
        f"{arm}-s{seed}",
        "cartpole",
        "none",
        seed,
        OK,
        fitness,
        fitness_name="return",
        metrics={"candidates": candidates, "fitness": fitness},
        start_time=start,
    )
    run.arm, run.curve, run.train_curve = arm, list(curve or []), list(train_curve or [])
    return run


LONG = "count_bonus plugins.count_bonus.beta=1.0 plugins.count_bonus.decay=0.99 trainer.ent_coef=0.01"


def test_reference_arms_come_first_then_the_declared_order():
    # a sweep '+plugins=[eureka],[text2reward],[]' starts eureka first and the baseline last
    runs = [
        _run("eureka", 0, 1.0, 1),
        _run("text2reward", 0, 1.0, 2),
        _run("baseline", 0, 1.0, 3),
        _run("eureka", 1, 1.0, 4),
        _run("text2reward", 1, 1.0, 5),
        _run("baseline", 1, 1.0, 6),
    ]
    assert arm_order(runs) == ["baseline", "eureka", "text2reward"]  # not alphabetical: eureka was declared first
    assert arm_order([_run("zeta", 0, 1.0, 1), _run("human", 0, 1.0, 2), _run("sparse", 0, 1.0, 3)]) == [
        "sparse",
        "human",
        "zeta",
    ]
    (task,) = analyze(runs, reps=50)
    assert [a.arm for a in task.arms] == ["baseline", "eureka", "text2reward"]
    # P(X > reference) first; the improvement figure draws each pair once, the later arm as X
    assert [(x, y) for x, y, _ in task.improvement][:2] == [("eureka", "baseline"), ("text2reward", "baseline")]
    fig = _improvement_figure(task)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["P(eureka > baseline)", "P(text2reward > baseline)", "P(text2reward > eureka)"]
    assert fig.axes[0].yaxis_inverted()  # the first pair on top


def test_long_arm_labels_are_shortened_wrapped_and_kept_whole(tmp_path: Path):
    label = short_label(LONG)
    assert "plugins.count_bonus." not in label and label.startswith("count_bonus beta=1.0")
    lines = label.split("\n")
    assert 1 < len(lines) <= LABEL_LINES and all(len(line) <= LABEL_WIDTH for line in lines)
    assert short_label("x " * 80).endswith("…")
    runs = [_run(LONG, s, float(s), s) for s in range(2)] + [_run("baseline", s, 1.0, 10 + s) for s in range(2)]
    (task,) = analyze(runs, reps=50)
    fig = _final_figure(task)
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert ticks[0].startswith("baseline") and ticks[1].startswith("count_bonus beta=1.0")
    renderer = fig.canvas.get_renderer()
    tight = fig.get_tightbbox(renderer)
    files = render_figures([task], tmp_path, kinds=("final",))
    height, width = matplotlib.image.imread(tmp_path / files["cartpole"][0]).shape[:2]
    # the saved image is the tight box around every artist: no label is cut at the edge
    pad = 2 * matplotlib.rcParams["savefig.pad_inches"]
    assert abs(width - (tight.width + pad) * fig.dpi) <= 3 and abs(height - (tight.height + pad) * fig.dpi) <= 3
    for text in fig.axes[0].get_yticklabels():
        box = text.get_window_extent(renderer)
        assert box.x0 >= tight.x0 * fig.dpi - 1


def test_a_best_of_n_score_against_one_training_carries_a_note():
    runs = [_run("baseline", s, 1.0 + s, s) for s in range(2)] + [
        _run("eureka", s, 3.0, 10 + s, candidates=4) for s in range(2)
    ]
    (task,) = analyze(runs, reps=50)
    md = render_markdown([task], runs, "abl", 50, {})
    assert "**Best of N**: the score of eureka (best of 4)" in md and "against one training per run of baseline" in md
    assert "| eureka | 2/2 |" in md and "| 4 | complete |" in md
    (fresh,) = analyze(runs, reps=50, metric="final/fresh_mean")  # scored on fresh seeds: nothing to say
    assert "Best of N" not in render_markdown([fresh], runs, "abl", 50, {})


def test_curves_fall_back_to_training_returns_when_evaluations_are_too_few():
    train = [(500, 10.0), (1000, 20.0), (1500, 30.0)]
    runs = [_run("baseline", s, 1.0, s, curve=[(2000, 9.0)], train_curve=train) for s in range(2)]
    runs += [_run("eureka", s, 1.0, 10 + s, curve=[(2000, 9.0)], train_curve=train) for s in range(2)]
    (task,) = analyze(runs, reps=50)
    assert task.curve_metric == TRAIN_RETURN and task.eval_points == 1
    assert task.arms[0].curve["frames"] == [500.0, 1000.0, 1500.0] and task.arms[0].curve["iqm"] == [10.0, 20.0, 30.0]
    md = render_markdown([task], runs, "abl", 50, {})
    assert "**Curves from training returns**: a run of this task has 1 evaluation(s)" in md and TRAIN_RETURN in md
    enough = [_run("baseline", s, 1.0, s, curve=[(1000, 1.0), (2000, 2.0)], train_curve=train) for s in range(2)]
    (task,) = analyze(enough, reps=50)
    assert task.curve_metric == "fitness" and "Curves from" not in render_markdown([task], enough, "abl", 50, {})


def test_training_returns_are_read_from_the_best_candidate(tmp_path: Path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("small", artifact_location=(tmp_path / "art").as_uri())
    parent = client.create_run(exp, run_name="baseline-s0", tags={"plugins": "none", "env": "cartpole", "seed": "0"})
    pid = parent.info.run_id
    child = client.create_run(
        exp, run_name="it0-c0", tags={MLFLOW_PARENT_RUN_ID: pid, "candidate": "it0-c0", "seed": "0"}
    )
    for frames, value in [(256, 12.0), (512, 20.0), (768, 31.0)]:
        client.log_metric(child.info.run_id, TRAIN_RETURN, value, step=frames)
    client.log_metric(child.info.run_id, "fitness", 40.0, step=768)
    client.set_terminated(child.info.run_id)
    client.log_metric(pid, "fitness", 40.0)
    client.set_tag(pid, "best_candidate", "it0-c0")
    client.set_terminated(pid)
    (run,) = assign_arms(load_study(uri, "small"))
    assert run.curve == [(768, 40.0)] and run.train_curve == [(256, 12.0), (512, 20.0), (768, 31.0)]
    (task,) = analyze([run], reps=50)
    assert task.curve_metric == TRAIN_RETURN
