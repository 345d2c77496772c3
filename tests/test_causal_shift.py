"""(Module `core.losses`.) Whether a causal LM's own loss shifts its labels, decided robustly: at random init a model's
loss over its labels as they stand and shifted one position are both about log(V), so a comparison within 1e-3 alone
could take a causal LM for an unshifted one (and count every micro-batch's tokens wrong). The class's own word (a
Hugging Face causal LM shifts), a float64 comparison that must be clear, undecided otherwise and asked again."""
import warnings

import pytest
import torch, torch.nn as nn, torch.nn.functional as F
from types import SimpleNamespace

from accum_callback.core.losses import _RULES, _own_rule, declared_rule, own_loss_items

T = pytest.importorskip('transformers')
V,IGNORE = 1000,-100

def llama(seed, tied):
    torch.manual_seed(seed)
    c = T.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=tied)
    return T.LlamaForCausalLM(c)

def gpt2(seed, tied):
    torch.manual_seed(seed)
    c = T.GPT2Config(vocab_size=V, n_positions=32, n_embd=16, n_layer=1, n_head=2, tie_word_embeddings=tied,
                     bos_token_id=0, eos_token_id=0)
    return T.GPT2LMHeadModel(c)

class OwnLoss(nn.Module):
    "blurr's way: the batch's dict to the model, which computes its loss from `labels`"
    def __init__(self, hf): super().__init__(); self.hf = hf
    def forward(self, x): return self.hf(**x)

def batch(seed):
    "4 rows of 12 tokens, the last 3 of each -100 (padding)"
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (4, 12), generator=g)
    lab = ids.clone(); lab[:, 9:] = IGNORE
    return ids,lab

def run(model, seed):
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='.*(loss_type|bos_token_id|eos_token_id).*')
        ids,lab = batch(seed)
        with torch.no_grad(): out = model(input_ids=ids, labels=lab)
    return out,lab

@pytest.mark.parametrize('make', [llama, gpt2])
@pytest.mark.parametrize('tied', [False, True])
def test_a_causal_lm_at_random_init_is_found_to_shift_in_every_seed(make, tied):
    """30 seeds of a tiny causal LM at random init, tied and untied embeddings: the float64 comparison alone (no class
    to go by) decides 'shifted' in every seed, and so does the class. The 1e-3 comparison alone is not enough: untied,
    the unshifted cross-entropy is within it in some seeds (counted here, so that this test is known to tell them apart)"""
    close = 0
    for seed in range(30):
        m = make(seed, tied)
        out,lab = run(m, seed)
        assert _own_rule(out, lab, out.loss) == ('shifted', True), seed
        assert declared_rule(m) == declared_rule(OwnLoss(m)) == 'shifted'
        t = float(F.cross_entropy(out.logits.reshape(-1, V), lab.reshape(-1)))
        close += abs(t - float(out.loss)) <= 1e-3*abs(float(out.loss))
    if not tied: assert close > 0   # (where the old rule, unshifted first within 1e-3, was wrong)

def test_seq2seq_and_other_models_are_not_said_to_shift():
    "T5 (sequence to sequence) averages over its labels as they stand; a model that is not Hugging Face's says nothing"
    c = T.T5Config(vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0)
    assert declared_rule(T.T5ForConditionalGeneration(c)) == 'tokens'
    assert declared_rule(nn.Linear(2, 2)) is None and declared_rule(None) is None
    two = nn.ModuleList([gpt2(0, True), gpt2(1, True)])   # (two models: which one's loss it is cannot be told)
    assert declared_rule(two) is None

def view(loss, logits, labels, model=None):
    return SimpleNamespace(pred=dict(loss=loss, logits=logits), loss_grad=loss, xb=({'labels': labels},), model=model)

def test_undecided_is_asked_again_at_the_next_micro_batch():
    """Logits that do not tell (uniform: both candidates are log(V) exactly): the closer one counts this micro-batch and
    nothing is kept; the next micro-batch, whose logits tell, decides, and that is kept for the model"""
    labels = torch.tensor([[3, 4, 5, IGNORE], [6, 7, IGNORE, IGNORE]])
    a = nn.Linear(1, 1)
    flat = torch.zeros(2, 4, 40)
    loss = F.cross_entropy(flat.reshape(-1, 40), labels.reshape(-1), ignore_index=IGNORE)
    assert own_loss_items(view(loss, flat, labels, a)) is not None and a not in _RULES
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 40)*3
    shifted = F.cross_entropy(logits[:, :-1].reshape(-1, 40), labels[:, 1:].reshape(-1), ignore_index=IGNORE)
    assert int(own_loss_items(view(shifted, logits, labels, a))) == 3 and _RULES[a] == 'shifted'
    tokens = F.cross_entropy(logits.reshape(-1, 40), labels.reshape(-1), ignore_index=IGNORE)
    assert int(own_loss_items(view(tokens, logits, labels, a))) == 3   # (kept: the model shifts)

def test_the_class_breaks_a_tie_the_logits_cannot():
    "Where both candidates match (uniform logits), a class that says it shifts decides at once"
    labels = torch.tensor([[3, 4, 5, IGNORE], [6, 7, IGNORE, IGNORE]])
    flat = torch.zeros(2, 4, 40)
    loss = F.cross_entropy(flat.reshape(-1, 40), labels.reshape(-1), ignore_index=IGNORE)
    assert _own_rule(dict(loss=loss, logits=flat), labels, loss)[1] is False
    assert _own_rule(dict(loss=loss, logits=flat), labels, loss, 'shifted') == ('shifted', True)
    off = loss + 1   # (neither candidate matches)
    assert _own_rule(dict(loss=off, logits=flat), labels, off, 'shifted') == (None, True)

def test_a_learner_counts_an_untied_llama_as_shifted_at_random_init():
    """In a fit: a seed where the unshifted cross-entropy is within 1e-3 of the model's loss; each micro-batch of the
    window is counted by its shifted labels (the model's own count)"""
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    from fastai.optimizer import SGD
    from fastai.callback.core import Callback
    from accum_callback import GradientAccumulation
    from accum_callback.core.losses import micro_items
    m = llama(0, False)
    ids,lab = batch(0)
    ds = [(ids[i], lab[i]) for i in range(4)]
    def f(b):
        x,y = torch.stack([x for x,_ in b]),torch.stack([y for _,y in b])
        return {'input_ids': x, 'labels': y},y
    dls = DataLoaders(DataLoader(ds, bs=2, create_batch=f), DataLoader(ds, bs=2, create_batch=f), device='cpu')
    dls.n_inp = 1
    class Counts(Callback):
        order = 0
        def before_fit(self): self.n = []
        def before_backward(self): self.n.append(int(micro_items(self.learn, None, 0)))   # (before ours weighs it)
    learn = Learner(dls, OwnLoss(m), loss_func=lambda out, *y: out.loss, opt_func=SGD, lr=1e-3,
                    cbs=[GradientAccumulation(n_step=2), c := Counts()])
    with learn.no_logging(), warnings.catch_warnings():
        warnings.filterwarnings('ignore')
        learn.fit(1)
    assert c.n == [int((lab[s:s+2, 1:] != IGNORE).sum()) for s in (0, 2)]
