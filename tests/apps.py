"""One small Learner per fastai application, built with fastai's own function and data API (so that `predict`, `tta`,
`export` and `load_learner` work as they do for users), for the application matrix (`tests/test_matrix.py`) and its
distributed cells (`tests/ddp_worker.py`); and the matrix's oracle (`Oracle`) and simulated device (`OOMAbove`).

Each `Row` builds its Learner with no pretrained weights, dropout off unless asked, and says what the matrix needs to
know of it: how one batch of several micro-batches is formed (`join`: fastai's own collation for padded text), the
loss a training step computes from the model's output (`loss`: the callbacks' `after_pred`/`after_loss` written out,
so that the oracle does not reuse the library's replay), whether it has BatchNorm, whether its model carries state
from one batch to the next, and an item for `predict`."""
from __future__ import annotations
import math, operator
from dataclasses import dataclass, field
from functools import partial

import numpy as np, pandas as pd, torch, torch.nn as nn
import torch.distributed as dist
from fastai.callback.core import Callback
from fastai.data.block import CategoryBlock, DataBlock, TransformBlock
from fastai.data.transforms import IndexSplitter
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from fastai.optimizer import SGD

from accum_callback import GradientAccumulation, MicroBatching
from accum_callback.core.distributed import is_ddp, unwrap
from accum_callback.micro import copy_module
from accum_callback.testing import OutOfMemoryAbove
from helpers import as64, flat, floor_tol, rel_err

__all__ = ['Row', 'ROWS', 'rows_with', 'Oracle', 'OOMAbove', 'quiet_fit']

N_TRAIN,BS = 24,4   # training items, loader batch

# -- picklable getters (export pickles the loaders' transforms) -------------------------------------------------------
def _img(o): from fastai.vision.core import PILImage; return PILImage.create(o['x'])
def _mask(o): from fastai.vision.core import PILMask; return PILMask.create(o['y'])
def _label(o): return o['y']
def _tokens(o): return o['x']
def _as_tensor(o): return torch.as_tensor(o, dtype=torch.float32)

def _rng(seed=0): return np.random.default_rng(seed)

# -- rows ----------------------------------------------------------------------------------------------------------
class TinyNet(nn.Module):
    "A resnet-shaped body small enough for the CPU: convolutions with BatchNorm, then the pooling `create_body` cuts at"
    def __init__(self, pretrained=False, c=3, nf=8):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, nf, 3, padding=1), nn.BatchNorm2d(nf), nn.ReLU(),
                                  nn.Conv2d(nf, nf, 3, stride=2, padding=1), nn.BatchNorm2d(nf), nn.ReLU(),
                                  nn.Conv2d(nf, 2*nf, 3, stride=2, padding=1), nn.BatchNorm2d(2*nf), nn.ReLU())
    def forward(self, x): return self.body(x)

def tiny_arch(pretrained=False):
    "An `arch` for `vision_learner`/`unet_learner`: fastai cuts it at its last pooling layer"
    m = TinyNet()
    return nn.Sequential(*m.body, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

def _images(n, px=16, seed=0, masks=False, n_cls=3):
    r = _rng(seed)
    x = r.integers(0, 256, (n, px, px, 3), dtype=np.uint8)
    if masks: return [dict(x=x[i], y=r.integers(0, n_cls, (px, px), dtype=np.uint8)) for i in range(n)]
    return [dict(x=x[i], y=str(r.integers(0, n_cls))) for i in range(n)]

def _splits(n_train, n_valid): return IndexSplitter(list(range(n_train, n_train+n_valid)))

def vision(cbs=(), dropout=False, bs=BS, seed=0, **kw):
    from fastai.vision.all import ImageBlock, vision_learner
    items = _images(N_TRAIN+8, seed=seed)
    dls = DataBlock(blocks=(ImageBlock, CategoryBlock), get_x=_img, get_y=_label, splitter=_splits(N_TRAIN, 8)
                    ).dataloaders(items, bs=bs, shuffle=False, device='cpu', num_workers=0)
    torch.manual_seed(seed)
    return vision_learner(dls, tiny_arch, pretrained=False, ps=0.5 if dropout else 0., lin_ftrs=[16], opt_func=SGD,
                          lr=0.05, loss_func=CrossEntropyLossFlat(), cbs=list(cbs), **kw)

def unet(cbs=(), dropout=False, bs=BS, seed=0, **kw):
    from fastai.vision.all import ImageBlock, MaskBlock, unet_learner
    items = _images(N_TRAIN+8, seed=seed, masks=True, n_cls=4)   # label 3 is ignored by the loss, the others weighted
    dls = DataBlock(blocks=(ImageBlock, MaskBlock(codes=['a', 'b', 'c', 'void'])), get_x=_img, get_y=_mask,
                    splitter=_splits(N_TRAIN, 8)).dataloaders(items, bs=bs, shuffle=False, device='cpu', num_workers=0)
    torch.manual_seed(seed)
    return unet_learner(dls, tiny_arch, pretrained=False, n_out=3, opt_func=SGD, lr=0.05, loss_func=CrossEntropyLossFlat(axis=1, ignore_index=3, weight=torch.tensor([1., 2., 0.5])),
                        cbs=list(cbs), **kw)

VOCAB = ['xxunk', 'xxpad', 'xxbos', 'xxeos'] + [f'w{i}' for i in range(36)]
AWD = dict(emb_sz=8, n_hid=12, n_layers=2)

def _texts(n, seed=0, ragged=False):
    """Texts of 6 to 72 tokens (padded batches of other lengths), each with a label; the last 8 are the validation set.
    Every length is a multiple of the 6 of `seq_len`. Other lengths make fastai's classifier itself depend on the batch
    a text is in (not per-sample, whatever accumulates it; `ragged=True` gives them, for tests/test_check.py): fastai pads
    a batch by whole chunks of 6 in front and the rest at the end, its `SentenceEncoder` takes a chunk's rows by count
    (`input[:real_bs]`, so a row padded at the end of the last chunk puts another row out of it), and its pooling takes
    the "last" output `mask[:, -6:]` places before the end, which counts front padding reaching into the last 6."""
    r = _rng(seed)
    lengths = r.integers(3, 40, n) if ragged else 5 + 6*r.integers(0, 12, n)   # words, after xxbos
    return pd.DataFrame(dict(text=[' '.join(['xxbos'] + [f'w{j}' for j in r.integers(0, 36, k)]) for k in lengths],
                             label=[['neg', 'pos'][i] for i in r.integers(0, 2, n)], is_valid=[False]*(n-8) + [True]*8))

def _text_block(**kw):
    "fastai's `TextBlock.from_df` with a whitespace tokenizer (no spaCy model to download) and a fixed vocabulary"
    from fastai.text.all import BaseTokenizer, TextBlock
    return TextBlock.from_df('text', vocab=VOCAB, seq_len=6, tok=BaseTokenizer(), rules=[], n_workers=0, **kw)

def text_classifier(cbs=(), dropout=False, bs=BS, seed=0, ragged=False, **kw):
    """`text_classifier_learner(AWD_LSTM)` on padded batches of varying length (fastai's `SortedDL` and `pad_input_chunk`,
    unshuffled so that a batch of several loader batches holds the same samples), AR/TAR on"""
    from fastai.text.all import AWD_LSTM, ColReader, ColSplitter, awd_lstm_clas_config, text_classifier_learner
    dls = DataBlock(blocks=(_text_block(), CategoryBlock), get_x=ColReader('text'), get_y=ColReader('label'),
                    splitter=ColSplitter()).dataloaders(_texts(N_TRAIN+8, seed, ragged), bs=bs, shuffle=False, device='cpu', num_workers=0)
    torch.manual_seed(seed)
    # drop_mult 1e-9, not 0: fastai 2.8's WeightDropout registers torch 2.14's dropout output for p=0 as a parameter
    return text_classifier_learner(dls, AWD_LSTM, pretrained=False, seq_len=6, config=dict(awd_lstm_clas_config, **AWD),
                                   drop_mult=0.5 if dropout else 1e-9, ps=None if dropout else [0.], opt_func=SGD, lr=0.1,
                                   cbs=list(cbs), **kw)   # (the head's dropout, 0.1 by default, does not follow drop_mult)

def language_model(cbs=(), dropout=False, bs=BS, seed=0, **kw):
    "`language_model_learner(AWD_LSTM)`: its hidden state carries one row per batch row into the next batch"
    from fastai.text.all import AWD_LSTM, ColReader, ColSplitter, awd_lstm_lm_config, language_model_learner
    dls = DataBlock(blocks=_text_block(is_lm=True), get_x=ColReader('text'), splitter=ColSplitter()
                    ).dataloaders(_texts(N_TRAIN+8, seed), bs=bs, seq_len=6, shuffle=False, device='cpu', num_workers=0)
    torch.manual_seed(seed)
    return language_model_learner(dls, AWD_LSTM, pretrained=False, config=dict(awd_lstm_lm_config, **AWD),
                                  drop_mult=0.5 if dropout else 1e-9, opt_func=SGD, lr=0.5, cbs=list(cbs), **kw)

def _table(n, seed=0):
    r = _rng(seed)
    return pd.DataFrame(dict(a=r.normal(size=n), b=r.normal(size=n)*3+1, c=r.choice(['x', 'y', 'z'], n),
                             d=r.choice(['p', 'q'], n), y=r.choice(['0', '1', '2'], n)))

def tabular(cbs=(), dropout=False, bs=BS, seed=0, **kw):
    "`tabular_learner`: embeddings, BatchNorm of the continuous inputs and in its layers"
    from fastai.tabular.all import Categorify, Normalize, TabularDataLoaders, tabular_config, tabular_learner
    df = _table(N_TRAIN+8, seed)
    dls = TabularDataLoaders.from_df(df, procs=[Categorify, Normalize], cat_names=['c', 'd'], cont_names=['a', 'b'],
                                     y_names='y', y_block=CategoryBlock(), bs=bs, valid_idx=list(range(N_TRAIN, N_TRAIN+8)),
                                     shuffle=False, device='cpu', num_workers=0)
    torch.manual_seed(seed)
    cfg = tabular_config(ps=0.3 if dropout else 0., embed_p=0.1 if dropout else 0.)
    return tabular_learner(dls, layers=[8], n_out=3, config=cfg, opt_func=SGD, lr=0.1, cbs=list(cbs), **kw)

def _ratings(n, seed=0):
    r = _rng(seed)
    return pd.DataFrame(dict(user=r.integers(0, 6, n), item=r.integers(0, 8, n), rating=r.uniform(0.5, 5., n).astype('float32')))

def collab(cbs=(), dropout=False, bs=BS, seed=0, use_nn=False, **kw):
    "`collab_learner`: dot product with biases, or `use_nn=True` (an embedding network with BatchNorm)"
    from fastai.collab import CollabDataLoaders, collab_learner
    from fastai.tabular.all import tabular_config
    df = _ratings(N_TRAIN+8, seed)
    dls = CollabDataLoaders.from_df(df, valid_pct=8/(N_TRAIN+8), seed=seed, bs=bs, shuffle=False, device='cpu', num_workers=0)
    torch.manual_seed(seed)
    extra = dict(layers=[8], config=tabular_config(ps=0.3 if dropout else 0., embed_p=0.1 if dropout else 0.)) if use_nn else {}
    return collab_learner(dls, n_factors=4, use_nn=use_nn, y_range=(0, 5.5), opt_func=SGD, lr=0.1, cbs=list(cbs), **extra, **kw)

class TwoInput(nn.Module):
    "Two inputs (`n_inp=2`): a vector and a second vector of another size, each through its own dropout"
    def __init__(self, p=0.):
        super().__init__()
        self.a,self.b,self.da,self.db,self.head = nn.Linear(5, 8),nn.Linear(3, 8),nn.Dropout(p),nn.Dropout(p),nn.Linear(8, 3)
    def forward(self, x1, x2): return self.head(torch.tanh(self.da(self.a(x1)) + self.db(self.b(x2))))

def _vectors(n, seed=0):
    r = _rng(seed)
    return [dict(x=r.normal(size=5).astype('float32'), x2=r.normal(size=3).astype('float32'), y=str(r.integers(0, 3)))
            for _ in range(n)]

def two_input(cbs=(), dropout=False, bs=BS, seed=0, **kw):
    items = _vectors(N_TRAIN+8, seed)
    dls = DataBlock(blocks=(TransformBlock(type_tfms=_as_tensor), TransformBlock(type_tfms=_as_tensor), CategoryBlock),
                    getters=[operator.itemgetter('x'), operator.itemgetter('x2'), operator.itemgetter('y')], n_inp=2,
                    splitter=_splits(N_TRAIN, 8)).dataloaders(items, bs=bs, shuffle=False, device='cpu', num_workers=0)
    torch.manual_seed(seed)
    return Learner(dls, TwoInput(0.3 if dropout else 0.), loss_func=CrossEntropyLossFlat(), opt_func=SGD, lr=0.1, cbs=list(cbs), **kw)

class DictNet(nn.Module):
    "Returns a dict, as Hugging Face-style models do: the logits and an auxiliary output (dropout on the input and the hidden layer)"
    def __init__(self, p=0.):
        super().__init__()
        self.d0,self.l1,self.d1,self.l2 = nn.Dropout(p),nn.Linear(5, 8),nn.Dropout(p),nn.Linear(8, 3)
    def forward(self, x):
        h = torch.tanh(self.l1(self.d0(x)))
        return dict(logits=self.l2(self.d1(h)), hidden=h)

class PickLogits(Callback):
    "Picks the logits from the model's dict for the loss and the metrics (what users write for such models)"
    order = -5
    def after_pred(self): self.learn.pred = self.pred['logits']

def dict_output(cbs=(), dropout=False, bs=BS, seed=0, **kw):
    items = _vectors(N_TRAIN+8, seed)
    dls = DataBlock(blocks=(TransformBlock(type_tfms=_as_tensor), CategoryBlock), getters=[operator.itemgetter('x'), operator.itemgetter('y')],
                    splitter=_splits(N_TRAIN, 8)).dataloaders(items, bs=bs, shuffle=False, device='cpu', num_workers=0)
    torch.manual_seed(seed)
    return Learner(dls, DictNet(0.3 if dropout else 0.), loss_func=CrossEntropyLossFlat(), opt_func=SGD, lr=0.1,
                   cbs=[PickLogits()] + list(cbs), **kw)

# -- what the oracle needs of each row ---------------------------------------------------------------------------------
def cat_join(batches):
    "One batch of several micro-batches `[(xb, yb), ...]`: every tensor joined along its first dimension"
    return tuple(tuple(torch.cat(ts) for ts in zip(*[b[k] for b in batches])) for k in (0, 1))

def text_join(batches, pad_idx=1, seq_len=6):
    """One batch of several padded text micro-batches as fastai collates it: each sample's tokens without padding, the
    longest first (as `SortedDL` orders them), then `pad_input_chunk`"""
    from fastai.text.data import pad_input_chunk
    from fastai.text.data import TensorText
    from fastai.torch_core import TensorCategory
    samples = [(TensorText(x[x != pad_idx]), TensorCategory(y)) for (xb,),(yb,) in batches for x,y in zip(xb, yb)]
    samples.sort(key=lambda s: -len(s[0]))   # stable: a batch's own order (longest first) is kept
    out = pad_input_chunk(samples, pad_idx=pad_idx, seq_len=seq_len)
    return (torch.stack([o[0] for o in out]),),(torch.stack([o[1] for o in out]),)

def plain_loss(learn, model, xb, yb):
    "The loss a training step computes: the model's output through the callbacks that pick it (here: none or `PickLogits`)"
    out = model(*xb)
    if isinstance(out, dict): out = out['logits']
    return learn.loss_func(out, *yb)

def rnn_loss(learn, model, xb, yb):
    "fastai's RNNCallback + RNNRegularizer written out: the loss of the first output, plus AR on the dropped-out outputs and TAR on the raw ones"
    pred,raw,out = model(*xb)
    reg = next((cb for cb in learn.cbs if type(cb).__name__ == 'RNNRegularizer'), None)   # (fastai adds none for alpha=beta=0)
    loss = learn.loss_func(pred, *yb)
    if reg is not None and reg.alpha: loss = loss + reg.alpha*out.float().pow(2).mean()
    if reg is not None and reg.beta and raw.shape[1] > 1: loss = loss + reg.beta*(raw[:, 1:]-raw[:, :-1]).float().pow(2).mean()
    return loss

# what each row's users call to predict, on a raw item as they have it (made again: an exported Learner keeps no data)
def predict_image(learn): return learn.predict(_images(N_TRAIN+1)[N_TRAIN])[-1]
def predict_mask(learn): return learn.predict(_images(N_TRAIN+1, masks=True, n_cls=4)[N_TRAIN])[-1]
def predict_vector(learn): return learn.predict(_vectors(N_TRAIN+1)[N_TRAIN])[-1]
def predict_text(learn): return learn.predict('xxbos w1 w2 w3')[-1]

def predict_words(learn):
    "A language model's `predict` samples the next words: seeded, so that two Learners with equal weights agree"
    torch.manual_seed(0)
    return learn.predict('xxbos w1 w2', n_words=3, no_bar=True)

def predict_row(learn): return learn.predict(_table(N_TRAIN+8).iloc[N_TRAIN])[-1]
def predict_ratings(learn): return learn.get_preds(dl=learn.dls.test_dl(_ratings(N_TRAIN+8).iloc[:3]))[0]

@dataclass
class Row:
    "A fastai application in the matrix: `make(cbs, dropout=False, bs=4)` -> Learner"
    name: str
    make: callable
    bn: bool = False           # has BatchNorm layers
    dropout: bool = True       # has a dropout to switch on
    stateful: bool = False     # carries state from one loader batch to the next (the big batch is another computation)
    join: callable = cat_join
    loss: callable = plain_loss
    predict: callable = predict_vector   # what its users call to predict (fastai's `predict`, or `get_preds` on a test_dl)
    preds_kw: dict = field(default_factory=dict)   # `get_preds` arguments (fastai's LMDataLoader cannot reorder)
    tta: bool = True           # fastai's `tta` works on its loaders
    ddp: bool = False          # a row of the distributed cells
    spans_kw: dict = field(default_factory=dict)   # `make` arguments where windows span loader batches
    state64: callable = None   # casts the state a float64 copy of the model carries outside its parameters and buffers

ROWS = {r.name: r for r in [
    Row('vision', vision, bn=True, predict=predict_image, ddp=True),
    Row('unet', unet, bn=True, dropout=False, predict=predict_mask),
    # AR/TAR average over every padded position: windows of loader batches padded to other lengths weigh them otherwise
    # than one batch does (the check's 'regularizer' cause, tests/test_check.py); pieces of one batch share its padding
    Row('text_classifier', text_classifier, bn=True, join=text_join, loss=rnn_loss, predict=predict_text, ddp=True,
        spans_kw=dict(alpha=0., beta=0.)),
    Row('language_model', language_model, stateful=True, loss=rnn_loss, predict=predict_words,
        preds_kw=dict(reorder=False), tta=False, state64=lambda m: setattr(m[0], 'hidden', as64(m[0].hidden))),
    Row('tabular', tabular, bn=True, predict=predict_row, tta=False, ddp=True),
    Row('collab_dot', collab, dropout=False, predict=predict_ratings, tta=False),
    Row('collab_nn', partial(collab, use_nn=True), bn=True, predict=predict_ratings, tta=False),
    Row('two_input', two_input),
    Row('dict_output', dict_output),
]}

def rows_with(**kw)->list: return [n for n,r in ROWS.items() if all(getattr(r, k) == v for k,v in kw.items())]

# -- the oracle: the step's gradient against one batch of the window's samples ----------------------------------------
def _copy(model):
    "A copy of the model as it is: weights, buffers, a language model's hidden state, the hooks fastai's models keep (U-Net)"
    return copy_module(unwrap(model))

class _WindowStart(Callback):
    "The model as each window starts, before `MicroBatching` gives a piece its rows of a stateful model's state"
    order,run_valid = MicroBatching.order-1,False
    def __init__(self): self.model0,self.fresh = None,True
    def before_batch(self):
        if self.fresh: self.model0,self.fresh = _copy(self.learn.model),False   # (a retried micro-batch keeps it)

class Oracle(Callback):
    """After `GradientAccumulation` has scaled a window's gradient, before the step: the relative error of the gradient
    against the gradient of the row's loss on one batch of the window's samples (`row.join`), from `_WindowStart`'s
    copy, computed in float64 (`errs`); float32's own large batch's error against it (`floors`) gives the tolerance (`tol`)"""
    order,run_valid = GradientAccumulation.order+1,False
    def __init__(self, row:Row, oom=None):
        self.row,self.start,self.errs,self.floors,self.buf,self.oom,self.ddp_steps = row,_WindowStart(),[],[],[],oom,0
    def before_fit(self):
        self.buf,self.start.fresh = [],True
        self.learn.gradient_accumulation.on_window_close(self._closed)
    def after_fit(self): self.learn.gradient_accumulation.remove_window_listener(self._closed)
    def _closed(self, stepped:bool): self.buf,self.start.fresh = [],True
    def after_backward(self):
        if self.learn.gradient_accumulation.window.counted:
            self.buf.append((tuple(x.detach() for x in self.xb), tuple(y.detach() for y in self.yb)))
    def before_step(self):
        rng = torch.get_rng_state()
        if self.oom is not None: self.oom.enabled = False   # the simulated device has room for the oracle
        try: self.errs.append(self._error())
        finally:
            torch.set_rng_state(rng)
            if self.oom is not None: self.oom.enabled = True
    @property
    def tol(self)->float: return floor_tol(self.floors)
    def _error(self)->float:
        m,live = self.start.model0,list(unwrap(self.model).parameters())
        try: xb,yb = self.row.join(self.buf)
        except RuntimeError: return math.inf   # no one batch of these (a language model's short last batch beside full ones)
        got = flat([q.grad if q.grad is not None else torch.zeros_like(q) for q in live if q.requires_grad]).double()
        if is_ddp(self.model): self.ddp_steps += 1
        f32 = next(m.parameters()).dtype == torch.float32
        if f32:   # copied before the float32 pass, which moves a stateful model's state on
            m64 = copy_module(m, computed=lambda t: t.detach().double()).double()
            if self.row.state64 is not None: self.row.state64(m64)
        rng = torch.get_rng_state()
        ref = self._big_grad(m, live, xb, yb)
        if f32:
            torch.set_rng_state(rng)   # the same dropout masks
            ref64 = self._big_grad(m64, live, as64(xb), as64(yb))
            self.floors.append(rel_err(ref, ref64)); ref = ref64
        return rel_err(got, ref)
    def _big_grad(self, m, live, xb, yb):
        loss = self.row.loss(self.learn, m, xb, yb)
        ps = [p for p,q in zip(m.parameters(), live) if q.requires_grad]
        ref = torch.autograd.grad(loss, ps, allow_unused=True)
        ref = flat([r if r is not None else torch.zeros_like(p) for r,p in zip(ref, ps)]).double()
        if is_ddp(self.model):   # one batch of every rank's window: the item-weighted mean of the ranks' means
            n = torch.tensor([float(yb[0].shape[0])], dtype=torch.float64)
            ref = torch.cat([ref*n, n]); dist.all_reduce(ref); ref = ref[:-1]/ref[-1]
        return ref

def quiet_fit(learn, epochs=1, meth='fit', **kw):
    with learn.no_bar(), learn.no_logging(): getattr(learn, meth)(epochs, **kw)
    return learn

class OOMAbove(OutOfMemoryAbove):
    """A simulated GPU: `OutOfMemoryAbove`'s rule where a layer of the model or the torch loss inside fastai's (forward
    pre-hooks) sees more than `n` items, in training (`phase='train'`) or in inference"""
    def __init__(self, where:str, phase:str, n:int=3): super().__init__(n, phase=phase); self.where,self.handles = where,[]
    def install(self, learn):
        if self.where == 'forward':
            for m in unwrap(learn.model).modules():
                if not list(m.children()) and list(m.parameters(recurse=False)): self.handles.append(m.register_forward_pre_hook(self._pre(1)))
        else:   # the torch loss inside fastai's sees the targets flattened: so many rows per item
            y = learn.dls.valid.one_batch()[learn.dls.n_inp]
            self.handles.append(learn.loss_func.func.register_forward_pre_hook(self._pre(y.numel()//y.shape[0])))
        return self
    def __enter__(self): return self
    def __exit__(self, *exc):   # fastai's losses can be shared between Learners (a class attribute of `Categorize`)
        for h in self.handles: h.remove()
    def _pre(self, per_item:int):
        def pre(mod, inp):
            k = inp[0].shape[0]//per_item if inp and isinstance(inp[0], torch.Tensor) and inp[0].ndim else 0
            if k and self.refuses(k): self.refuse(k)
        return pre
