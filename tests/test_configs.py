"""Every shipped config and experiment preset loads and passes validation (what `flatlm train` checks first)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REPO

from flatlm import claims
from flatlm.config import load_config
from flatlm.experiment import load_experiment, run_config, validate_experiment
from flatlm.train.loop import validate

NAMES = ("fig1_after_convergence", "fig2_model_sizes", "fig3_sgd", "fig5_grown_sizes", "table1", "table1_hmm",
         "table2", "flatness_seeking", "flatness_seeking_encoder", "stacking", "fig2_width_depth", "fig2_depth",
         "adversarial_strength", "adversarial_dose")
RUN_CONFIGS = [f"{REPO}/configs/{name}.py:{preset}" for name in ("hmm_mlm", "pcfg_mlm")
               for preset in ("tiny", "cpu", "demo", "paper")]
RUN_CONFIGS += [f"{REPO}/configs/opt_mlm.py:{p}" for p in ("tiny", "paper")]
RUN_CONFIGS += [f"{REPO}/configs/scb_mlm.py:{p}" for p in ("tiny", "cpu")]
EXPERIMENTS = [f"{REPO}/configs/experiments/{name}.py:{arg}" for name in NAMES
               for arg in ("tiny", "cpu", "paper", "tiny,hmm", "cpu,pcfg", "paper,pcfg")]


@pytest.mark.parametrize("spec", RUN_CONFIGS)
def test_run_configs_validate(spec):
    config = load_config(spec)
    validate(config, num_devices=1)


@pytest.mark.parametrize("spec", EXPERIMENTS)
def test_experiment_configs_validate(spec):
    exp = load_experiment(spec)
    validate_experiment(exp)
    assert exp.runs and all(run_config(exp, r).train.steps > 0 for r in exp.runs)


@pytest.mark.parametrize("name", NAMES)
def test_cpu_presets_fix_three_pretraining_seeds(name):
    """Every cpu experiment repeats each run over pre-training seeds 0, 1, 2 fixed in advance; without a language
    the cpu scale is the HMM (with the paper's BiLSTM, except Figure 5, whose growth needs BERT), table1 the PCFG."""
    exp = load_experiment(f"{REPO}/configs/experiments/{name}.py:cpu")
    configs = [run_config(exp, r) for r in exp.runs]
    assert sorted({c.seed for c in configs}) == [0, 1, 2] and len(configs) % 3 == 0
    language = {c.language.name for c in configs}
    assert language == ({"pcfg"} if name in ("table1", "table2") else {"hmm"})
    kinds = {c.model.kind for c in configs}
    assert kinds == ({"bert"} if name in ("table1", "table2", "fig5_grown_sizes", "stacking") else {"lstm"})
    if name in ("fig2_model_sizes", "fig5_grown_sizes", "fig2_width_depth"):
        assert len({(c.model.d_model, c.model.d_hidden, c.model.num_layers) for c in configs}) >= 3
    if name == "fig1_after_convergence":
        c = configs[0]
        assert c.checkpoint.after_convergence and c.train.schedule == "constant"
        assert c.checkpoint.convergence_max_kl == claims.MAX_KL  # converged means inside the "same loss" band
    if name in ("fig1_after_convergence", "fig3_sgd", "fig5_grown_sizes", "table1_hmm", "table2",
                "adversarial_strength", "adversarial_dose"):
        assert exp.flatness.enabled and exp.flatness.method == "fisher"


@pytest.mark.parametrize("preset", ["tiny", "cpu", "paper"])
def test_stacking_arms_end_at_the_plain_arms_shape(preset):
    """configs/experiments/stacking.py: plain and every stacking rule train the same final shape for the same steps,
    the stacked arms through the same stages, each rule once per seed."""
    exp = load_experiment(f"{REPO}/configs/experiments/stacking.py:{preset}")
    configs = [run_config(exp, r) for r in exp.runs]
    shapes = {(c.model.num_layers, c.model.d_model, c.train.steps) for c in configs}
    assert len(shapes) == 1
    (layers, _, steps), = shapes
    stacked = [c for c in configs if c.train.stacking.stages]
    stages = {tuple(map(tuple, c.train.stacking.stages)) for c in stacked}
    assert len(stages) == 1 and len(configs) - len(stacked) == len({c.seed for c in configs})
    (st,) = stages
    assert st[-1][0] == layers and sum(n for _, n in st) == steps and len(st) >= 3
    assert sorted(c.train.stacking.rule for c in stacked if c.seed == 0) == ["function_preserving", "midas", "top"]


def test_cpu_run_presets_are_the_measured_scales():
    hmm = load_config(f"{REPO}/configs/hmm_mlm.py:cpu")
    language = hmm.language
    assert (hmm.model.kind, language.num_states, language.vocab_size, language.length) == ("lstm", 12, 20, 8)
    pcfg = load_config(f"{REPO}/configs/pcfg_mlm.py:cpu")
    assert pcfg.model.kind == "bert" and pcfg.language.grammar.levels < 4


def test_table2_is_the_papers_pcfg_task_c_comparison_with_trace():
    """Table 2 (Section 5): AdamW vs adversarial on PCFG task C, the adversarial head on task C, Tr(H) measured."""
    for preset in ("tiny", "cpu", "paper"):
        exp = load_experiment(f"{REPO}/configs/experiments/table2.py:{preset}")
        configs = {r["name"]: run_config(exp, r) for r in exp.runs}
        assert {c.language.name for c in configs.values()} == {"pcfg"} and exp.flatness.enabled
        assert all(tuple(c.eval.tasks) == ("C",) and c.train.adversarial.task == "C" for c in configs.values())
        assert any(c.train.adversarial.lam > 0 for c in configs.values())
        assert any(c.train.adversarial.lam == 0 for c in configs.values())
    hmm = load_experiment(f"{REPO}/configs/experiments/table1_hmm.py:tiny")
    assert {run_config(hmm, r).language.name for r in hmm.runs} == {"hmm"}


STRENGTHS = {"adversarial_strength": {"tiny": (1.5, 3.0), "cpu": (1.0, 1.5), "paper": (0.1, 0.3, 1.0)},
             "adversarial_dose": {"tiny": (0.5, 1.5), "cpu": (0.1, 0.3), "paper": (0.01, 0.03)}}


@pytest.mark.parametrize("name", sorted(STRENGTHS))
@pytest.mark.parametrize("preset", ["tiny", "cpu", "paper"])
def test_adversarial_strength_is_table1_hmm_but_for_lam(name, preset):
    """adversarial_strength.py / adversarial_dose.py: table1_hmm's AdamW run and its adversarial runs at other
    strengths, every other setting equal (so their AdamW runs are table1_hmm's, seed for seed)."""
    strength = load_experiment(f"{REPO}/configs/experiments/{name}.py:{preset}")
    table = load_experiment(f"{REPO}/configs/experiments/table1_hmm.py:{preset}")
    ours = {r["name"]: run_config(strength, r) for r in strength.runs}
    theirs = {r["name"]: run_config(table, r) for r in table.runs}
    lams = {c.train.adversarial.lam for c in ours.values()} - {0.0}
    assert lams == set(STRENGTHS[name][preset])
    reference = next(c for n, c in theirs.items() if n.startswith("adversarial") and n.endswith("-seed0"))
    for run_name, c in ours.items():
        same = theirs["adamw-seed0"] if run_name.startswith("adamw") else reference
        a, b = c.to_dict(), same.to_dict()
        for d in (a, b):
            d.pop("seed"), d.pop("config_spec"), d["train"]["adversarial"].pop("lam")
        assert a == b, run_name
    assert strength.flatness.to_dict() == table.flatness.to_dict()


@pytest.mark.parametrize("experiment", ["flatness_seeking", "flatness_seeking_encoder"])
def test_flatness_seeking_runs_differ_only_in_the_flat_objective(experiment):
    """Issue 18: AdamW vs SAM vs label noise vs the Tr(H) penalty (on the encoder's blocks only in the follow-up),
    same base, same seeds, every config valid."""
    for preset in ("tiny", "cpu"):
        exp = load_experiment(f"{REPO}/configs/experiments/{experiment}.py:{preset}")
        validate_experiment(exp)
        configs = {r["name"]: run_config(exp, r) for r in exp.runs}
        methods = {"none", "sam", "trace_penalty"} | ({"label_noise"} if experiment == "flatness_seeking" else set())
        assert {c.train.flat.method for c in configs.values()} == methods
        if experiment == "flatness_seeking_encoder":
            assert {(c.train.flat.method == "none", c.train.flat.blocks) for c in configs.values()} == {
                (True, "all"), (False, "encoder")}
            assert {c.seed for c in configs.values()} == ({0, 1} if preset == "tiny" else {0, 1, 2})
        for name, c in configs.items():
            a, b = c.to_dict(), configs[name.replace(name.split("-seed")[0], "adamw")].to_dict()
            a["train"].pop("flat"), b["train"].pop("flat"), a.pop("config_spec", None), b.pop("config_spec", None)
            assert a == b, name


def test_table1_runs_differ_only_in_the_algorithm():
    exp = load_experiment(f"{REPO}/configs/experiments/table1.py:tiny")
    runs = {r["name"]: run_config(exp, r) for r in exp.runs}
    assert sorted(runs) == ["adamw-seed0", "adamw-seed1", "adversarial-lam1-seed0", "adversarial-lam1-seed1"]
    for seed in (0, 1):
        plain, adv = runs[f"adamw-seed{seed}"], runs[f"adversarial-lam1-seed{seed}"]
        assert plain.train.adversarial.lam == 0 and adv.train.adversarial.lam > 0 and plain.seed == adv.seed == seed
        a, b = plain.to_dict(), adv.to_dict()
        a["train"].pop("adversarial"), b["train"].pop("adversarial")
        a.pop("config_spec"), b.pop("config_spec")
        assert a == b


def test_sgd_protocol_is_warmup_12_percent_then_constant():
    from flatlm.train.optim import schedule

    exp = load_experiment(f"{REPO}/configs/experiments/fig3_sgd.py:tiny")
    c = run_config(exp, exp.runs[0])
    assert c.train.optimizer == "sgd" and c.train.warmup_frac == 0.12 and c.train.schedule == "constant"
    lr = schedule(c.train)
    warm = round(0.12 * c.train.steps)
    assert float(lr(0)) == 0.0 and float(lr(warm // 2)) == pytest.approx(c.train.lr / 2, rel=0.05)
    assert float(lr(warm)) == pytest.approx(c.train.lr) and float(lr(c.train.steps)) == pytest.approx(c.train.lr)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_weight_decay_is_decoupled_from_the_momentum(momentum):
    """Audit regression: with momentum the decay went into the momentum buffer (plain L2). Under a zero gradient
    decoupled SGDW shrinks a decayed weight by (1 - lr wd) per step, whatever the momentum (closed form); a bias
    (outside the decay mask) stays; with a gradient the update is lr (m_t + wd w), m_t the gradients' momentum."""
    import jax
    import jax.numpy as jnp
    import optax
    from ml_collections import ConfigDict

    from flatlm.train.optim import optimizer

    train = ConfigDict(dict(optimizer="sgd", lr=0.1, momentum=momentum, weight_decay=0.5, schedule="constant",
                            warmup_frac=0.0, steps=10, grad_clip=0.0))
    opt = optimizer(train)
    params = {"w": jnp.ones((2, 2)), "bias": jnp.ones(2)}
    state = opt.init(params)
    zero = jax.tree.map(jnp.zeros_like, params)
    for t in range(1, 4):
        upd, state = opt.update(zero, state, params)
        params = optax.apply_updates(params, upd)
        assert float(params["w"][0, 0]) == pytest.approx(0.95**t, rel=1e-6) and float(params["bias"][0]) == 1.0
    g = {"w": jnp.full((2, 2), 2.0), "bias": jnp.zeros(2)}
    m = 0.0
    for _ in range(3):
        w = float(params["w"][0, 0])
        m = momentum * m + 2.0
        upd, state = opt.update(g, state, params)
        params = optax.apply_updates(params, upd)
        assert float(params["w"][0, 0]) == pytest.approx(w - 0.1 * (m + 0.5 * w), rel=1e-6)


def test_pcfg_grammar_and_max_length_come_from_the_config():
    """language.grammar / language.max_length reach random_grammar (a smaller grammar, capped sentences), and a
    grammar that cannot be built is a one-line UserError."""
    from flatlm.config import apply_overrides, load_config
    from flatlm.errors import UserError
    from flatlm.languages import make_language
    from flatlm.languages.pcfg import random_grammar

    c = apply_overrides(load_config(str(REPO / "configs" / "pcfg_mlm.py") + ":tiny"),
                        ["--config.language.grammar.levels=3", "--config.language.grammar.num_words=50",
                         "--config.language.max_length=12", "--config.language.seed=3"])
    g = make_language(c.language.to_dict())
    want = random_grammar(3, levels=3, num_words=50, max_length=12)
    assert (g.vocab_size, g.max_length, g.num_nonterminals) == (50, 12, 39)
    np.testing.assert_array_equal(g.binary, want.binary)
    assert g.sample(64, seed=0).lengths.max() <= 12
    c.language.grammar.num_words = 5
    with pytest.raises(UserError, match="language.grammar"):
        make_language(c.language.to_dict())


def test_paper_presets_follow_the_papers_protocols():
    """A.1, A.3, A.5, A.6, B.1, B.2: corpus sizes, the exact loss's sample, fine-tuning, Tr(H) and Figure 3's lr."""
    pcfg, hmm = load_config(f"{REPO}/configs/pcfg_mlm.py:paper"), load_config(f"{REPO}/configs/hmm_mlm.py:paper")
    opt = load_config(f"{REPO}/configs/opt_mlm.py:paper")
    assert (pcfg.data.train_size, hmm.data.train_size, opt.data.train_size) == (2 * 10**7, 10**7, 2 * 10**8)
    assert opt.data.source == "stream"
    for c in (pcfg, hmm):
        assert c.data.eval_size == 10**6 and c.eval.num_subsets == 5 and c.eval.loss_average == "sentence"
    for c in (pcfg, hmm, opt):
        assert (c.eval.finetune.epochs, c.eval.finetune.warmup_steps) == (10, 200)
    assert hmm.model.kind == "lstm" and pcfg.model.kind == "bert"
    for name in ("fig1_after_convergence", "fig3_sgd", "fig5_grown_sizes", "table1", "table2"):
        exp = load_experiment(f"{REPO}/configs/experiments/{name}.py:paper")
        f = exp.flatness
        assert (f.num_batches * f.batch_size, f.draws, f.num_batches) == (10_000, 50, 5)
    sgd = load_experiment(f"{REPO}/configs/experiments/fig3_sgd.py:paper")
    assert {run_config(sgd, r).train.lr for r in sgd.runs} == {1e-3}
    assert {run_config(sgd, r).train.warmup_frac for r in sgd.runs} == {0.12}


@pytest.mark.parametrize("arg", ["tiny", "cpu", "paper", "cpu,pcfg", "paper,pcfg"])
def test_width_depth_crosses_two_widths_with_two_depths(arg):
    """fig2_width_depth: every (width, depth) of a 2 x 2 grid once per seed, the runs otherwise identical; at cpu
    scale its smallest and largest cells are fig2_model_sizes's lstm32-L1 and lstm128-L2 runs, setting for setting."""
    exp = load_experiment(f"{REPO}/configs/experiments/fig2_width_depth.py:{arg}")
    configs = {r["name"]: run_config(exp, r) for r in exp.runs}
    field = "d_hidden" if {c.model.kind for c in configs.values()} == {"lstm"} else "d_model"
    cells = [(getattr(c.model, field), c.model.num_layers, c.seed) for c in configs.values()]
    widths, depths = sorted({w for w, _, _ in cells}), sorted({d for _, d, _ in cells})
    assert len(widths) == len(depths) == 2 and len(set(cells)) == len(cells)
    assert sorted(cells) == sorted((w, d, s) for w in widths for d in depths for s in {c[2] for c in cells})
    strip = lambda c: {k: v for k, v in c.to_dict().items() if k not in ("model", "config_spec")}  # noqa: E731
    assert all(strip(c) == strip(c0) for c in configs.values()
               for c0 in [next(x for x in configs.values() if x.seed == c.seed)])
    if arg == "cpu":
        fig2 = load_experiment(f"{REPO}/configs/experiments/fig2_model_sizes.py:cpu")
        for r in fig2.runs:
            if r["name"].split("-seed")[0] in ("lstm32-L1", "lstm128-L2"):
                want, got = run_config(fig2, r), configs[r["name"]]
                assert {**want.to_dict(), "config_spec": ""} == {**got.to_dict(), "config_spec": ""}


@pytest.mark.parametrize("arg", ["tiny", "cpu"])
def test_depth_series_probes_every_inner_layer_and_matches_width_depth(arg):
    """fig2_depth: one width, depths 1..3, each run probing its layers 1..depth-1 besides the last; at cpu scale its
    one- and two-layer runs are fig2_width_depth's lstm128-L1 / -L2, setting for setting but the probed layers."""
    exp = load_experiment(f"{REPO}/configs/experiments/fig2_depth.py:{arg}")
    configs = {r["name"]: run_config(exp, r) for r in exp.runs}
    for c in configs.values():
        assert tuple(c.eval.probe.layers) == tuple(range(1, c.model.num_layers))
    assert sorted({c.model.num_layers for c in configs.values()}) == [1, 2, 3]
    if arg == "cpu":
        wd = load_experiment(f"{REPO}/configs/experiments/fig2_width_depth.py:cpu")
        for r in wd.runs:
            if r["name"].split("-seed")[0] in ("lstm128-L1", "lstm128-L2"):
                want, got = run_config(wd, r).to_dict(), configs[r["name"]].to_dict()
                got["eval"]["probe"]["layers"] = want["eval"]["probe"]["layers"]
                assert {**want, "config_spec": ""} == {**got, "config_spec": ""}
