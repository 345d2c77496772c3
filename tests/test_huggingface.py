"""(Modules `losses`, `check`, `micro`.) Hugging Face models in a fastai Learner (issue 62): tiny configs with random
weights, nothing downloaded. An encoder classifier (BERT), a causal LM (GPT-2) and an encoder-decoder (T5); dict inputs
(`input_ids`, `attention_mask`, `labels`, blurr's and HF's batches) and tuple inputs; the model's own loss
(`loss_func=lambda out, *y: out.loss`) and `CrossEntropyLossFlat(ignore_index=-100)`; texts padded per batch to their
longest, labels -100 at padding. Every optimizer step against one batch of the same samples (float64), the check's
verdicts, `micro_bs`, a resume, the noise scale."""
import warnings

import pytest
import torch, torch.nn as nn
from fastai.callback.core import Callback
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from fastai.optimizer import SGD

from accum_callback import Checkpoint, GradientAccumulation, GradientNoiseScale, MicroBatching
from helpers import SmoothingInLossDtype, accumulation

T = pytest.importorskip('transformers')
V,IGNORE = 40,-100
KINDS = ('bert', 'gpt2', 't5')

def hf_model(kind, dropout=0., seed=0):
    "A tiny model of `kind`, random weights"
    torch.manual_seed(seed)
    if kind == 'gpt2':
        c = T.GPT2Config(vocab_size=V, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=dropout, embd_pdrop=dropout,
                         attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
        return T.GPT2LMHeadModel(c)
    if kind == 'bert':
        c = T.BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                         num_labels=3, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, max_position_embeddings=32)
        return T.BertForSequenceClassification(c)
    c = T.T5Config(vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, dropout_rate=dropout,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T.T5ForConditionalGeneration(c)

def texts(kind, n=16, seed=1, learnable=False):
    "`n` (token ids, target) of 3 to 11 tokens: a class for BERT, the text itself for GPT-2, its reverse for T5"
    g,out = torch.Generator().manual_seed(seed),[]
    for _ in range(n):
        L = int(torch.randint(3, 12, (1,), generator=g))
        ids = (torch.arange(L) + int(torch.randint(2, V-12, (1,), generator=g))) if learnable else torch.randint(2, V, (L,), generator=g)
        out.append((ids, int(torch.randint(0, 3, (1,), generator=g)) if kind == 'bert' else ids.flip(0) if kind == 't5' else ids.clone()))
    return out

def collate(kind, dict_input, shift):
    """Pad a batch to its longest text. Labels -100 at padding; for GPT-2 with `shift`, labels moved one to the left (what
    `CrossEntropyLossFlat` on its logits needs; its own loss shifts them itself)"""
    def f(b):
        W = max(max(len(x), len(y) if torch.is_tensor(y) else 0) for x,y in b)
        ids,mask = torch.zeros(len(b), W, dtype=torch.long),torch.zeros(len(b), W, dtype=torch.long)
        lab = torch.tensor([y for _,y in b]) if kind == 'bert' else torch.full((len(b), W), IGNORE)
        for i,(x,y) in enumerate(b):
            ids[i,:len(x)] = x; mask[i,:len(x)] = 1
            if kind != 'bert': lab[i,:len(y)] = y
        if kind == 'gpt2' and shift: lab = torch.cat([lab[:, 1:], torch.full((len(b), 1), IGNORE)], 1)
        if dict_input: return ({'input_ids': ids, 'attention_mask': mask, 'labels': lab}, lab)
        return (ids, mask, lab, lab) if kind == 't5' else (ids, mask, lab)   # (T5's decoder reads its inputs from the labels)
    return f

class OwnLoss(nn.Module):
    "blurr's way: the batch's dict to the model, which computes its loss from `labels`"
    def __init__(self, hf): super().__init__(); self.hf = hf
    def forward(self, x): return self.hf(**x)

class Logits(nn.Module):
    "The logits, from a dict (labels given to T5 for its decoder inputs only) or from `(input_ids, attention_mask)`"
    def __init__(self, hf): super().__init__(); self.hf = hf
    def forward(self, x, mask=None, labels=None):
        if mask is not None: x = dict(input_ids=x, attention_mask=mask, labels=labels)
        keep = ('input_ids', 'attention_mask') + (('labels',) if isinstance(self.hf, T.T5ForConditionalGeneration) else ())
        return self.hf(**{k: v for k,v in x.items() if k in keep}).logits

class LabelsInTuple(nn.Module):
    "Its own loss, from labels given as a plain argument: the library cannot see what it averages over"
    def __init__(self, hf): super().__init__(); self.hf = hf
    def forward(self, ids, mask, labels): return self.hf(input_ids=ids, attention_mask=mask, labels=labels)

def own_loss(out, *y): return out.loss

def learner(kind, setup='dict_own', bs=4, cbs=(), n=16, dtype=torch.float64, dropout=0., shuffle=False, learnable=False, lr=0.1):
    """`setup`: 'dict_own' (dict inputs, the model's own loss), 'dict_ce' / 'tuple_ce' (CrossEntropyLossFlat on the
    logits), 'tuple_own' (labels as a plain argument, the model's own loss)"""
    inp,loss = setup.split('_')
    ds = texts(kind, n, learnable=learnable)
    f = collate(kind, inp == 'dict', loss == 'ce')
    if setup == 'tuple_own' and kind != 't5': g = f; f = lambda b: (lambda ids, mask, lab: (ids, mask, lab, lab))(*g(b))
    dls = DataLoaders(DataLoader(ds, bs=bs, create_batch=f, shuffle=shuffle), DataLoader(ds[:4], bs=4, create_batch=f), device='cpu')
    dls.n_inp = 1 if inp == 'dict' else 2 + (setup == 'tuple_own' or kind == 't5')
    hf = hf_model(kind, dropout).to(dtype)
    model = OwnLoss(hf) if setup == 'dict_own' else LabelsInTuple(hf) if setup == 'tuple_own' else Logits(hf)
    cbs = list(cbs) + [SmoothingInLossDtype()]
    learn = Learner(dls, model, loss_func=own_loss if loss == 'own' else CrossEntropyLossFlat(ignore_index=IGNORE),
                    opt_func=SGD, lr=lr, cbs=cbs)
    learn.recorder.train_metrics = False
    return learn

class Steps(Callback):
    "The weights after every optimizer step"
    order = 99
    def before_fit(self): self.weights = []
    def after_step(self): self.weights.append(torch.cat([p.detach().reshape(-1).clone() for p in self.model.parameters()]))

def stepped(learn, n_epoch=1):
    learn.add_cb(s := Steps())
    with learn.no_logging(), warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='.*(loss_type|bos_token_id|eos_token_id).*')   # (transformers' remarks on tiny configs)
        learn.fit(n_epoch)
    return s.weights

def worst(a, b)->float: return max(float((x-y).abs().max()/y.abs().max()) for x,y in zip(a, b))

CUTS = {'n_step': (4, dict(n_step=2)), 'micro_bs': (8, dict(n_step=1, micro_bs=2)), 'auto': (8, dict(n_step=1, micro_bs='auto'))}

@pytest.mark.parametrize('cut', ['n_step', 'micro_bs'])
@pytest.mark.parametrize('setup', ['dict_own', 'dict_ce', 'tuple_ce'])
@pytest.mark.parametrize('kind', KINDS)
def test_every_step_is_one_batch_of_the_same_samples(kind, setup, cut):
    """Windows of 8 texts (two loader batches of 4, or loader batches of 8 cut in 4 pieces of 2) against loader batches of
    8, float64: every optimizer step's weights within 1e-8 relative (measured: 1e-9 at most; T5 normalises in float32). The
    model's own loss too, with no `n_items`: its count (the labels not -100, shifted for a causal LM) is found"""
    bs,ga = CUTS[cut]
    acc = stepped(learner(kind, setup, bs, [*accumulation(**ga)]))
    one = stepped(learner(kind, setup, 8))
    assert len(acc) == len(one) == 2 and worst(acc, one) < 1e-8, worst(acc, one)

@pytest.mark.parametrize('kind', ['gpt2', 't5'])
def test_the_count_matters_so_the_comparison_can_fail(kind):
    "The same windows weighed by rows (the batch-size rule) are far off: the count is what makes them exact"
    from fastai.torch_core import find_bs
    acc = stepped(learner(kind, 'dict_own', 4, [GradientAccumulation(n_step=2, n_items=lambda learn: find_bs(learn.yb))]))
    one = stepped(learner(kind, 'dict_own', 8))
    assert worst(acc, one) > 1e-4, worst(acc, one)

def test_auto_micro_bs_on_dict_batches():
    "micro_bs='auto' on dict inputs: each loader batch one piece (nothing ran out of memory), the same steps"
    acc = stepped(learner('gpt2', 'dict_own', 8, [*accumulation(**CUTS['auto'][1])]))
    one = stepped(learner('gpt2', 'dict_own', 8))
    assert worst(acc, one) < 1e-8

@pytest.mark.parametrize('setup', ['dict_own', 'tuple_ce'])
@pytest.mark.parametrize('kind', KINDS)
def test_the_check_says_exact(kind, setup):
    "float32, as users train: exact within float32's tolerance, no cause, on outputs padded to other widths and ModelOutputs"
    r = learner(kind, setup, 4, [GradientAccumulation(n_step=2)], dtype=torch.float32).check_accumulation()
    assert r.exact and r.causes == () and r.rel_error <= r.tol == 1e-5, r

@pytest.mark.parametrize('kind', KINDS)
def test_the_check_names_dropout(kind):
    r = learner(kind, 'dict_own', 4, [GradientAccumulation(n_step=2)], dtype=torch.float32, dropout=0.1).check_accumulation()
    assert not r.exact and r.causes == ('dropout',), r

@pytest.mark.parametrize('kind', ['gpt2', 't5'])
def test_a_loss_it_cannot_count_is_said_at_fit_start_and_named_by_the_check(kind):
    """The model's own loss from labels given as a plain argument: nothing tells the library what it averages over. The
    fit's first micro-batch says so, once; the check names `n_items`; with `n_items` it is exact"""
    learn = learner(kind, 'tuple_own', 4, [GradientAccumulation(n_step=2)], dtype=torch.float32)
    r = learn.check_accumulation()
    assert not r.exact and r.causes == ('n_items',), r
    with pytest.warns(UserWarning, match=r"its own loss .*n_items=") as w: stepped(learn)
    assert len([x for x in w if 'own loss' in str(x.message)]) == 1
    count = lambda learn: (learn.yb[0][..., 1 if kind == 'gpt2' else 0:] != IGNORE).sum()
    learn = learner(kind, 'tuple_own', 4, [GradientAccumulation(n_step=2, n_items=count)], dtype=torch.float32)
    assert learn.check_accumulation().exact

def test_an_unknown_loss_with_ignored_targets_is_said():
    "A loss function the library does not know, targets holding -100: said at fit start (the check names n_items)"
    learn = learner('gpt2', 'tuple_ce', 4, [GradientAccumulation(n_step=2)], dtype=torch.float32)
    ce = nn.functional.cross_entropy
    learn.loss_func = lambda out, y: ce(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    assert learn.check_accumulation().causes == ('n_items',)
    with pytest.warns(UserWarning, match=r"not one this library knows, and the targets hold -100"): stepped(learn)

def test_resumed_bitwise(tmp_path):
    "GPT-2, its own loss, dict batches, shuffled: stopped mid-window and run again, the uninterrupted run's weights"
    from fastai.torch_core import set_seed
    class Stop(Callback):
        order = 99
        def after_batch(self):
            if self.training and self.epoch == 1 and self.iter == 1: raise KeyboardInterrupt
    set_seed(0); ref = stepped(learner('gpt2', 'dict_own', 4, [GradientAccumulation(n_step=3)], shuffle=True), 2)
    set_seed(0); cut = learner('gpt2', 'dict_own', 4, [GradientAccumulation(n_step=3), Checkpoint(tmp_path, every=('1ep', '1ba')), Stop()], shuffle=True)
    with pytest.raises(KeyboardInterrupt): stepped(cut, 2)
    set_seed(0); again = learner('gpt2', 'dict_own', 4, [GradientAccumulation(n_step=3), cb := Checkpoint(tmp_path, every=('1ep', '1ba'))], shuffle=True)
    stepped(again, 2)
    assert cb.resumed_from is not None
    assert torch.equal(torch.cat([p.reshape(-1) for p in again.model.parameters()]), ref[-1])

def test_noise_scale_on_gpt2():
    """Finite and positive on text with something to learn (counting sequences); on random tokens the mean gradient can be
    lost in the noise, where B_simple is inf by definition (docs/noise_scale.md)"""
    learn = learner('gpt2', 'dict_own', 4, [GradientAccumulation(n_step=4), gns := GradientNoiseScale()], n=64,
                    dtype=torch.float32, shuffle=True, learnable=True, lr=0.5)
    stepped(learn, 2)
    assert gns.n_measured == 8 and 0 < gns.b_simple < float('inf'), gns.b_simple_history

def test_the_count_of_a_models_own_loss_is_found_per_model():
    """What a model's own loss averages over is decided once per model (by its logits), and each time where there is no
    model to remember it by: a shifted (causal LM) loss and a plain token loss, side by side, each counted as it is"""
    from types import SimpleNamespace
    import torch.nn.functional as F
    from accum_callback.core.losses import own_loss_items
    torch.manual_seed(0)
    labels = torch.tensor([[3, 4, 5, IGNORE], [6, 7, IGNORE, IGNORE]])
    logits = torch.randn(2, 4, V)
    tokens = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE)
    shifted = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=IGNORE)
    def view(loss, model=None):
        pred = dict(loss=loss, logits=logits)
        return SimpleNamespace(pred=pred, loss_grad=loss, xb=({'labels': labels},), model=model)
    assert int(own_loss_items(view(shifted))) == 3 and int(own_loss_items(view(tokens))) == 5   # (no model: each decided)
    a,b = nn.Linear(1, 1),nn.Linear(1, 1)
    assert int(own_loss_items(view(shifted, a))) == 3 and int(own_loss_items(view(tokens, b))) == 5
    assert int(own_loss_items(view(tokens, a))) == 3   # (model `a` was found to shift: it is counted so)

from hypothesis import HealthCheck, given, settings, strategies as st

@pytest.mark.filterwarnings("ignore:GradientAccumulation. the epoch")   # an epoch shorter than the window: said, and drawn here
@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(KINDS), setup=st.sampled_from(['dict_own', 'dict_ce', 'tuple_ce']),
       n=st.integers(6, 14), bs=st.integers(2, 5), cut=st.sampled_from(['n_step', 'micro_bs']), k=st.integers(2, 3))
def test_windows_of_any_size_are_one_batch_of_the_same_texts(kind, setup, n, bs, cut, k):
    """Features together, against the oracle: any number of texts (a partial last window), loader batches of any size,
    windows of `k` loader batches or loader batches cut by `micro_bs`, each model and input kind, the model's own loss
    or CrossEntropyLossFlat: every optimizer step within 1e-8 of one float64 batch of the same texts"""
    if cut == 'n_step': acc,big = learner(kind, setup, bs, [GradientAccumulation(n_step=k)], n=n),learner(kind, setup, bs*k, n=n)
    else: acc,big = learner(kind, setup, bs*k, [GradientAccumulation(n_step=1), MicroBatching(bs)], n=n),learner(kind, setup, bs*k, n=n)
    a,b = stepped(acc),stepped(big)
    assert len(a) == len(b) == -(-n//(bs*k)) and worst(a, b) < 1e-8, (len(a), len(b), worst(a, b))

# -- a model's own loss when an inference batch runs out of memory under MicroBatching('auto') --------------------------------
class OOMOverInference(nn.Module):
    "The model, raising out of memory for an inference batch of more than `n` rows (training passes)"
    def __init__(self, inner, n): super().__init__(); self.inner,self.n = inner,n
    def forward(self, x):
        if not torch.is_grad_enabled() and len(x['input_ids']) > self.n:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated inference: {len(x['input_ids'])} > {self.n})")
        return self.inner(x)

@pytest.mark.parametrize('kind', ['bert', 'gpt2'])
def test_a_models_own_loss_is_joined_by_its_counts_when_inference_is_cut(kind):
    """Validation batches of 4 texts cut into pieces of 2 after an out-of-memory error: the model's own loss of the whole
    batch is the pieces' losses weighted by what each averages over (BERT: rows; GPT-2: tokens with labels, its texts of
    other lengths making the unweighted mean differ), as the uncut batch's in `validate`. BERT's loss is float64 (within
    1e-12); GPT-2's own loss is computed in float32 whatever the model's dtype: within 8 float32 epsilons of it"""
    from accum_callback import MicroBatching
    ref = learner(kind, 'dict_own', cbs=[GradientAccumulation(n_step=1)])
    cut = learner(kind, 'dict_own', cbs=[GradientAccumulation(n_step=1), MicroBatching('auto')])
    cut.model = OOMOverInference(cut.model, 2)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        want,got = ref.validate()[0],cut.validate()[0]
        assert cut.micro_batching.inference_bs == 2
        tol = 1e-12 if kind == 'bert' else 8*torch.finfo(torch.float32).eps
        assert abs(got - want) <= tol*abs(want)
        if kind == 'bert': return
        b = next(iter(cut.dls.valid))
        halves = [ref.model({k: v[s:s+2] for k,v in b[0].items()}).loss.item() for s in (0, 2)]
        assert abs(sum(halves)/2 - want) > 1e-6*abs(want)   # (the unweighted join would be wrong: the test can fail)

class LogitsForPreds(Callback):
    "After the model's own loss: the prediction fastai gathers is the logits (fastai cannot concatenate a 0-d loss)"
    def after_loss(self): self.learn.pred = self.pred['logits']

class Losses(Callback):
    "The loss of every inference batch"
    def before_validate(self): self.values = []
    def after_loss(self):
        if not self.training: self.values.append(self.learn.loss.detach().clone())

def _tfmd_learner(kind, cbs):
    "`learner`, its validation loader a TfmdDL (what `predict` decodes with), float32 as users predict"
    from fastai.data.core import TfmdDL
    learn = learner(kind, 'dict_own', cbs=[GradientAccumulation(n_step=1), LogitsForPreds(), *cbs], dtype=torch.float32)
    learn.dls.loaders[1] = TfmdDL(texts(kind)[:4], bs=4, create_batch=collate(kind, True, False), num_workers=0)
    return learn

@pytest.mark.parametrize('kind', ['bert', 'gpt2'])
def test_get_preds_and_predict_are_the_uncut_batchs_when_inference_is_cut(kind):
    """`get_preds` of a batch of 4 texts cut into pieces of 2 after an out-of-memory error: the logits and the model's
    own loss (the pieces' weighted by their counts) are the uncut batch's, within float32's rounding of that batch
    (against float64: `helpers.floor_tol`); a one-text batch after it (what `predict` runs) too"""
    from helpers import f32_floor, floor_tol
    ref,cut = _tfmd_learner(kind, [lr := Losses()]),_tfmd_learner(kind, [MicroBatching('auto'), lc := Losses()])
    cut.model = OOMOverInference(cut.model, 2)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        with ref.no_bar(), cut.no_bar():
            (p,t),(pr,tr) = cut.get_preds(),ref.get_preds()
            assert cut.micro_batching.inference_bs == 2 and len(lc.values) == len(lr.values) == 1
            xb = next(iter(ref.dls.valid))[0]
            tol_p = floor_tol([f32_floor(lambda m, x: m(x)['logits'], ref.model, xb)])
            tol_l = floor_tol([f32_floor(lambda m, x: m(x)['loss'], ref.model, xb)])
            assert p.shape == pr.shape and torch.equal(t, tr)
            assert (p-pr).abs().max() <= tol_p*pr.abs().max(), ((p-pr).abs().max(), tol_p)
            assert abs(lc.values[0]-lr.values[0]) <= tol_l*abs(lr.values[0]), (lc.values, lr.values, tol_l)
            # `predict` of one text: fastai's own `predict` cannot reorder dict inputs (with or without our callbacks);
            # what it runs, `get_preds` on its one-item loader with the decoded predictions, is the uncut Learner's
            item = texts(kind)[5]
            with pytest.raises(TypeError) as e_cut: cut.predict(item)
            with pytest.raises(TypeError) as e_ref: ref.predict(item)
            assert str(e_cut.value) == str(e_ref.value)
            got,want = (l.get_preds(dl=l.dls.test_dl([item]), with_decoded=True) for l in (cut, ref))
    assert cut.micro_batching.inference_bs == 2
    for a,b in zip(got, want): assert a.shape == b.shape and (a-b).abs().max() <= tol_p*b.abs().max()
