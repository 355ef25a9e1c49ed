"""Post hoc (decided after the words-added lookup table's result): the same linear probe on the one-hot words alone,
[onehot(x_1); ...; onehot(x_T)] (zeros beyond a sentence's length), on each run's task data and probe seeds; and the
Bayes rate of the test split, E[max_j P(z_k = j | x)] (task k<k>, sampled states: no classifier of x does better).

    python docs/reproduction/cpu-band/c5-lookup-seeds-52-75/words_only.py runs/c5-52-75/table1_hmm-hmm/runs
"""

import json
import sys
from pathlib import Path

from flatlm.evaluate.lookup import bayes_accuracy, one_hot_words
from flatlm.evaluate.probe import ProbeConfig, run_probe
from flatlm.run import load_run


def main(root: str) -> None:
    out = {}
    for run_dir in sorted(Path(root).iterdir(), key=lambda p: p.name):
        run = load_run(str(run_dir), quiet=True)
        c, task = run.config, run.task_names()[0]
        data = run.load_task(task, quiet=True)
        feats = {s: one_hot_words(v["tokens"], v["length"], c.language.vocab_size) for s, v in data.items()}
        res = run_probe(feats, {s: v["label"] for s, v in data.items()}, ProbeConfig(**c.eval.probe, seed=c.seed),
                        num_classes=run.num_classes(task), progress=False)
        test = data["test"]
        bayes = bayes_accuracy(run.language.state_posteriors(test["tokens"], test["length"])[:, int(task[1:])])
        out[run_dir.name] = {"words": res["accuracy"]["test"]["mean"], "bayes": bayes}
        print(run_dir.name, task, f"words {100 * out[run_dir.name]['words']:.2f} bayes {100 * bayes:.2f}", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
