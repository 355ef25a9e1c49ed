"""When does seed 0's adversarial transition come? Closed-form-head accuracy and exact loss every 100 steps."""
import sys, time, functools
sys.path.insert(0, "tests")
import jax, jax.numpy as jnp, numpy as np, optax
from test_adversarial import _tiny_bert, _tiny_hmm
from test_adversarial_training import _d2_style_accuracy, _exact
from flatlm.data.masking import mask_batch
from flatlm.train import adversarial as adv
from flatlm.train.step import mlm_objective, train_step
seed = int(sys.argv[1]); total = int(sys.argv[2]); every = 100
lang = _tiny_hmm(); k, n_down, batch = 4, 64, 64
model, params = _tiny_bert(d_model=16, words=lang.vocab_size, length=lang.max_length)
opt = optax.adamw(3e-3, b1=0.9, b2=0.98, eps=1e-6, weight_decay=0.01)
cfg = adv.AdversarialConfig(lam=10.0, ridge=3.0, d1_size=n_down, d2_size=n_down, task=f"k{k}", num_classes=lang.num_states, seed=seed)
jit_step = lambda objective: jax.jit(functools.partial(train_step, apply_fn=model.apply, optimizer=opt, seed=seed, objective=objective, dropout=False))
rng = np.random.default_rng(seed)
def mlm_batches(n, offset):
    for i in range(n):
        corpus = lang.sample(batch, seed=1_000_000 * (seed + 1) + offset + i)
        yield mask_batch(corpus.tokens, corpus.lengths, lang.vocab_size, rng)
plain = jit_step(mlm_objective); advs = jit_step(adv.make_objective(cfg))
warm = 300
state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": opt.init(params)}
for b in mlm_batches(warm, 0): state, _ = plain(state, b)
down = adv.downstream_iterator(cfg, lang, start=warm)
s = {"plain": state, "adversarial": state}
t0 = time.time()
for i, b in enumerate(mlm_batches(total, warm), 1):
    s["plain"], _ = plain(s["plain"], b)
    s["adversarial"], _ = advs(s["adversarial"], {**b, **next(down)})
    if i % every == 0:
        p = {n: v["params"] for n, v in s.items()}
        acc = _d2_style_accuracy(lang, model, p); loss = _exact(lang, model, p)
        print(f"step {i}: acc {acc['plain']:.3f} -> {acc['adversarial']:.3f} (drop {acc['plain']-acc['adversarial']:+.3f}); "
              f"loss diff {loss['adversarial']['loss']-loss['plain']['loss']:+.4f}; plain kl {loss['plain']['kl']:.4f}  [{time.time()-t0:.0f}s]", flush=True)
