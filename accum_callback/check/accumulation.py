"""`learn.check_accumulation()`: is the accumulated gradient the big batch's on *this* Learner (its model, loss,
`GradientAccumulation` and `BatchNormAccumulation` settings, mixed precision), and if not, why? Every cause is found by
an experiment that switches the suspect off and sees the difference vanish, never guessed from the model's type. The
check works on a copy of the model: the Learner (weights, buffers, optimizer, RNG states, gradients, train/eval mode,
callbacks) is left exactly as it was."""
from __future__ import annotations
import math
from dataclasses import dataclass, field

import torch
from fastai.learner import Learner
from fastai.torch_core import find_bs, to_device
from fastcore.basics import patch

from ..window.accumulate import GradientAccumulation
from ..batchnorm.callback import BatchNormAccumulation
from ..compat.torch import BatchNormBase
from ..core.distributed import is_fsdp
from ..core.losses import loss_reduction, model_loss
from ..micro import cat_outputs, copy_module, halved, is_out_of_memory, micro_batching, n_pieces, slice_batch
from ..core.loaders import model_device
from ..micro.pieces import batch_tensors
from ..compat.torch import rngs_kept
from .replay import Replay, flat_out, micro_batches, training_model
from ..core.args import whole_number

__all__ = ['check_accumulation', 'AccumulationReport', 'CHECK_CAUSES', 'CAUSE_ADVICE', 'EXPECTED_CAUSES']

CHECK_CAUSES = ('loss_not_mean', 'n_items', 'regularizer', 'batchnorm', 'checkpoint', 'dropout', 'train_state', 'not_per_sample',
                'nonfinite', 'unexplained')
CAUSE_ADVICE = dict(
    loss_not_mean="the loss sums over its items (e.g. reduction='sum') where its micro-batches are weighed as means: use "
                  "reduction='mean', or a torch/fastai loss class with reduction='sum' (accumulated as the sum it is)",
    n_items="the loss averages over a count other than the batch size (class weights, ignore_index, padding): pass "
            "GradientAccumulation(n_items=lambda learn: <that count of learn.yb>)",
    regularizer="a callback adds a term to the loss (fastai's RNNRegularizer: AR/TAR) that averages over every position "
                "of the padded batch, so micro-batches padded to other lengths weigh it otherwise than one batch does: "
                "small and usually harmless; micro_bs (pieces of one loader batch share its padding) or alpha=beta=0 "
                "give the big batch's gradient",
    batchnorm="BatchNorm normalises each micro-batch with its own statistics: BatchNormAccumulation('window') (each "
              "window one loader batch cut by MicroBatching) normalises with the window's and gives the big batch's "
              "gradient (docs/batchnorm.md: its cost, and where it matters: MLPs with BatchNorm1d); 'freeze' or "
              "'groupnorm' give the big batch's gradient of another model; 'pool'/'momentum' keep the running "
              "statistics right and train on micro-batch statistics (ghost batch norm), usually harmless for conv nets",
    dropout="dropout (or another layer random in training) draws other masks for micro-batches than for one batch: "
            "expected and harmless, the same distribution",
    checkpoint="BatchNorm runs inside an activation-checkpointed block: the forward recomputed in the backward updates its "
               "running statistics a second time (pytorch#96136); BatchNormAccumulation('pool') or 'momentum' count each "
               "micro-batch once",
    train_state="a layer changes its own buffers at every training forward (spectral_norm's power iteration, a "
                "running average kept in forward): micro-batches run it once each where one batch runs it once, so "
                "the window is not the large batch; expected for spectral_norm, and small",
    not_per_sample="the model mixes the samples of a batch or carries state from one batch to the next: one big batch "
                   "is another computation (expected for language models; micro_bs splits their rows exactly)",
    nonfinite="a micro-batch gave a non-finite loss or gradient: GradientAccumulation(skip_nonfinite=True) drops its window",
    unexplained="the difference stays with BatchNorm, dropout and the loss ruled out: a layer or loss this check does not "
                "model (please report it)")

# the causes of a difference micro-batches must make, whatever the rule: the verdict's middle level
EXPECTED_CAUSES = dict(batchnorm="BatchNorm's micro-batch statistics", dropout="dropout's masks")

# relative error that counts as exact, by the dtype the model computes in
_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}

@dataclass
class AccumulationReport:
    """What `check_accumulation` found. `exact`: the accumulated gradient is the big batch's within `tol` (the tolerance
    of `dtype`); `rel_error`: relative L2 error over the whole model; `worst`: the parameter tensors furthest off, by
    name; `causes`: names from `CHECK_CAUSES`, each found by an experiment; `errors`: what each experiment measured
    (relative; the gradient with only that suspect on, or for the loss causes the loss of the whole batch against the
    counts-weighted losses of its parts); `advice`: one line per cause; `note`: how the micro-batches were chosen where
    not as the Learner's window stands (`micro_bs='auto'` before it has cut a batch)"""
    exact: bool   # (`level`: the verdict in three levels)
    rel_error: float
    tol: float
    dtype: str
    n_step: int
    micro_sizes: list
    worst: list = field(default_factory=list)
    causes: tuple = ()
    errors: dict = field(default_factory=dict)
    advice: dict = field(default_factory=dict)
    reference: str = 'device'   # where the big batch ran: the model's device, or 'cpu' after an out-of-memory error
    note: str = ''              # how the micro-batches were chosen, where not the Learner's window as it stands

    @property
    def level(self)->str:
        """The verdict in three levels: 'exact'; 'expected' (it differs only where micro-batches must: BatchNorm's
        micro-batch statistics, dropout's masks); 'not exact' (a cause with a fix, or one unexplained)"""
        if self.exact: return 'exact'
        return 'expected' if self.causes and set(self.causes) <= set(EXPECTED_CAUSES) else 'not exact'
    def verdict(self)->str:
        "The verdict's line"
        if self.level == 'exact': return 'exact'
        if self.level == 'expected':
            return f"differs only where expected ({', '.join(EXPECTED_CAUSES[c] for c in self.causes)}); the fix, if wanted, below"
        fix = [c for c in self.causes if c not in EXPECTED_CAUSES]
        return f"NOT exact ({', '.join(fix)}): the fix below" if fix else 'NOT exact'
    def rows(self)->list:
        rows = [('verdict', self.verdict()),
                ('relative error', f'{self.rel_error:.2e} (tolerance {self.tol:.0e}, {self.dtype})'),
                ('micro-batches', f"{self.n_step} of {'+'.join(map(str, self.micro_sizes))} items against one batch of {sum(self.micro_sizes)}")]
        if self.worst: rows.append(('worst tensors', ', '.join(f'{n} {e:.1e}' for n,e in self.worst)))
        for c in self.causes: rows.append((f'cause: {c}', f"{self.errors[c]:.1e}; {self.advice[c]}" if c in self.errors else self.advice[c]))
        if self.reference != 'device': rows.append(('note', f'the big batch ran on the {self.reference} (out of memory on the device)'))
        if self.note: rows.append(('note', self.note))
        return rows
    def __str__(self):
        rows = self.rows(); w = max(len(k) for k,_ in rows)
        return '\n'.join(['check_accumulation', '-'*(w+60)] + [f'{k:<{w}}  {v}' for k,v in rows])
    def _repr_markdown_(self):
        return '| check_accumulation | |\n|---|---|\n' + '\n'.join(f'| {k} | {v} |' for k,v in self.rows())
    __repr__ = __str__

# -- the experiments ---------------------------------------------------------------------------------------------------------
class Experiments(Replay):
    """The replay engine with the check's experiments. Two sets of micro-batches serve the output experiments: `exp`
    (the first two, which show a layer that mixes samples, or, on a model with per-row state cut in pieces, up to the
    first piece of the second loader batch, where the state carries over) and `clean` (the first micro-batch in two
    halves, each from its own rows of a stateful model's state: a set where one batch and its parts compute the same on a
    per-sample model, so that BatchNorm's and dropout's effects show alone)"""
    def load(self, batches:list, where:list):
        super().load(batches, where)
        starts = [i for i,(s,_,_) in enumerate(self.where) if s == 0 and i > 0]
        self.exp = list(range(starts[0]+1 if self.cut_rows and starts else min(2, len(self.batches))))
        s,e,n = self.where[0]
        if e-s >= 4:   # (halves of two items at least: BatchNorm cannot train on one)
            m = s + (e-s)//2
            xb,yb = self.batches[0]
            self.batches += [(slice_batch(xb, 0, m-s), slice_batch(yb, 0, m-s)), (slice_batch(xb, m-s, e-s), slice_batch(yb, m-s, e-s))]
            self.where += [(s, m, n), (m, e, n)]
            self.clean = [self.n_window, self.n_window+1]
        else: self.clean = self.exp

    def _run(self, m, idxs, parts:bool, draw:int):
        """Forward the micro-batches `idxs` through `m` (one after the other, or as one batch), what the loss sees of
        each, and the backward of half its sum of squares, a function of the output that adds over samples (a model
        per sample gives the parts' gradients summing to the whole's, whatever its loss). `draw`: the RNG moved on that
        many draws of every generator the forward may use first. Returns the outputs (flat) and the parameters'
        gradients (flat, float64)"""
        if draw:
            torch.rand(draw)
            if model_device(m).type == 'cuda': torch.rand(draw, device=model_device(m))
        ps = [p for p in m.parameters() if p.requires_grad]
        for p in ps: p.grad = None
        outs = []
        for xb,yb in (self.pieces(m, idxs) if parts else [self.joined(idxs)]):
            with self._ctx(m):
                pred = self._seen(m(*xb), xb, yb)
                s = _half_sq(pred)
            outs.append(flat_out(pred))
            if isinstance(s, torch.Tensor) and s.requires_grad: s.backward()
        g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().reshape(-1) for p in ps]) if ps else torch.zeros(0)
        return torch.cat(outs),g

    def trained(self, idxs, bn:bool, drop:bool, draw:int=0)->torch.Tensor:
        """What training uses of one batch of the micro-batches `idxs`: the output and a gradient it gives (`_run`), flat.
        The gradient too, because a random layer may change no output and still change what trains: timm
        zero-initialises the last norm of each residual branch (`zero_init_last`), so from scratch a drop-path or
        DropBlock there leaves the output as it is and changes only the gradients. Sets `state_changed`: did the
        forward change buffers outside BatchNorm?"""
        m = self.fresh(); self.modes(m, bn, drop)
        bufs = [(b, b.detach().clone()) for mod in m.modules() if not isinstance(mod, BatchNormBase) for b in mod.buffers(recurse=False)]
        out,g = self._run(m, idxs, False, draw)
        self.state_changed = any(not torch.equal(b, v) for b,v in bufs)
        return torch.cat([out, g])

    def train_effects(self, idxs, draws:int=4)->tuple[bool,bool,bool]:
        """What makes training mode differ, besides BatchNorm: `(train_mode, random, state)`, from what training uses of
        one batch of `idxs` (output and gradient, `trained`), BatchNorm quiet. train_mode: it differs from eval mode in
        one of `draws`+1 draws of the RNG; random: it changes with the draw (dropout, drop-path, DropBlock, inside a norm
        layer too; a layer that drops rarely, DropBlock on a small feature map, can draw "drop nothing" more than once,
        hence several draws); state: a forward changes buffers outside BatchNorm (spectral_norm's power iteration)"""
        quiet = self.trained(idxs, False, False)
        first = self.trained(idxs, False, True)
        state,train_mode,random_ = self.state_changed,not torch.equal(first, quiet),False
        for d in range(1, draws+1):
            if random_ and train_mode: break
            other = self.trained(idxs, False, True, d)
            random_ = random_ or not torch.equal(first, other)
            train_mode = train_mode or not torch.equal(other, quiet)
        return train_mode,random_,state

    def train_split(self, idxs, drop:bool, draw:int=0)->float:
        """The gradient of the micro-batches `idxs` run one after the other against that of one batch of them (`_run`:
        independent of the loss), BatchNorm quiet (running statistics), with every other train-mode behaviour on
        (`drop`) or off, the RNG `draw` draws on: relative"""
        gs = []
        for parts in (True, False):
            m = self.fresh(); self.modes(m, False, drop)
            gs.append(self._run(m, idxs, parts, draw)[1])
        return _rel(*gs)

    @torch.no_grad()
    def outputs(self, idxs, bn:bool, drop:bool)->tuple[float,list]:
        """Relative difference between what the loss sees (the output through the callbacks' `after_pred`) of the
        micro-batches `idxs` run one after the other and of one batch of them, compared row by row (`_row_diff`: outputs
        padded to other widths, output objects), and the micro-batches' outputs"""
        whole = self.whole(idxs, bn, drop)
        m = self.fresh(); self.modes(m, bn, drop)
        with self._ctx(m): preds = [self._seen(m(*xb), xb, yb) for xb,yb in self.pieces(m, idxs)]
        return _row_diff(preds, [e-s for s,e,_ in (self.where[i] for i in idxs)], whole),preds

    @torch.no_grad()
    def whole(self, idxs, bn:bool, drop:bool):
        "What the loss sees of one batch of the micro-batches `idxs`"
        m = self.fresh(); self.modes(m, bn, drop)
        xb,yb = self.joined(idxs)
        with self._ctx(m): return self._seen(m(*xb), xb, yb)

    @torch.no_grad()
    def loss_split(self, preds:list)->tuple[float,float]:
        """The loss of the experiment's micro-batches together against their own losses, on the same predictions `preds`
        (those of the deterministic `outputs(exp, False, False)` run): (error of the counts-weighted mean the Learner
        uses, error of a plain sum). The whole's predictions are the parts' joined, or where they cannot be joined
        (padded to other widths) or carry a loss of their own (a Hugging Face model's: computed from the whole batch),
        one batch of them run as the parts ran"""
        lf,bs,(_,yb_all) = self.learn.loss_func,[self.batches[i] for i in self.exp],self.joined(self.exp)
        try: joined = None if model_loss(preds[0]) is not None else cat_outputs(preds)
        except (TypeError, RuntimeError): joined = None
        big = float(lf(joined if joined is not None else self.whole(self.exp, False, False), *yb_all))
        ls,ns = [],[]
        for p,(xb,yb) in zip(preds, bs):
            l = lf(p, *yb)
            ls.append(float(l)); ns.append(self.count(xb, yb, p, l))
        if loss_reduction(lf) == 'sum': mean = sum(ls)
        else: mean = sum(l*n for l,n in zip(ls, ns) if n > 0)/max(sum(ns), 1e-30)
        d = max(abs(big), 1e-30)
        return abs(mean-big)/d, abs(sum(ls)-big)/d

    def regularizer(self)->tuple[float,float]:
        """The accumulated gradient against the big batch's with BatchNorm and dropout quiet, with the callbacks' loss
        terms (AR/TAR) and without them"""
        errs = []
        for on in (True, False):
            self.loss_terms = on
            try: errs.append(_rel(self.grads(True, bn=False, drop=False).flat, self.grads(False, bn=False, drop=False).flat))
            finally: self.loss_terms = True
        return tuple(errs)

def _worst(names, sizes, a, b, tol, k=3)->list:
    """The `k` parameter tensors whose gradients are furthest off (relative), above `tol`. A tensor whose gradient is, in
    both, below `tol` of the whole gradient's norm is not ranked: its relative error is rounding noise (a bias before a
    BatchNorm layer has no gradient but for rounding, whose ratio moved from 0.94 to 0.96 with the number of threads)"""
    if not names: return []
    d = torch.stack([x.norm() for x in (a-b).split(sizes)])
    nb,na = torch.stack([x.norm() for x in b.split(sizes)]),torch.stack([x.norm() for x in a.split(sizes)])
    e,floor = (d/nb.clamp_min(1e-30)).tolist(),tol*float(b.norm())
    judged = [i for i in range(len(e)) if max(float(na[i]), float(nb[i])) > floor or not math.isfinite(e[i])]
    return [(names[i], e[i]) for i in sorted(judged, key=lambda i: -e[i] if math.isfinite(e[i]) else -math.inf)[:k] if e[i] > tol]

def _half_sq(o):
    "Half the sum of squares of the floating tensors of an output that have a batch dimension (`batch_tensors`)"
    return sum((0.5*t.double().square().sum() for t in batch_tensors(o) if t.is_floating_point()), 0.)

def _crop(a:torch.Tensor, b:torch.Tensor)->tuple:
    """`a` and `b` cut to their common shape, where a micro-batch's output and the whole's rows of it are padded to other
    widths: aligned at the start (right padding) or at the end (left padding), whichever differs least"""
    if a.shape == b.shape or a.ndim != b.ndim: return a,b
    shape = [min(x, y) for x,y in zip(a.shape, b.shape)]
    head = lambda t: t[tuple(slice(0, n) for n in shape)]
    tail = lambda t: t[tuple(slice(t.shape[i]-n, t.shape[i]) for i,n in enumerate(shape))]
    return min(((head(a), head(b)), (tail(a), tail(b))), key=lambda p: float((p[0].double()-p[1].double()).norm()))

def _row_diff(parts:list, rows:list, whole)->float:
    """Relative difference between the outputs of micro-batches (`parts`, of `rows` rows each) and the rows of one batch
    of them (`whole`), leaf by leaf (`batch_tensors`), each pair cut to its common width (`_crop`)"""
    w,a,b,r = batch_tensors(whole),[],[],0
    for p,n in zip(parts, rows):
        for x,y in zip(batch_tensors(p), w):
            if not x.is_floating_point(): continue
            x,y = _crop(x.detach().double(), y[r:r+n].detach().double())
            a.append(x.reshape(-1)); b.append(y.reshape(-1))
        r += n
    return _rel(torch.cat(a), torch.cat(b)) if a else 0.

def _rel(a, b)->float:
    "Relative L2 error of `a` against `b` (inf where either is not finite)"
    if not b.numel(): return 0.
    d,n = float((a-b).norm()),float(b.norm())
    return d/max(n, 1e-30) if math.isfinite(d) and math.isfinite(n) else math.inf

# -- the check ------------------------------------------------------------------------------------------------------------------
def _run_check(learn, n_step:int|None=None)->AccumulationReport:
    """Compare the gradient `learn` accumulates over `n_step` micro-batches of its training loader with the gradient of
    one batch of exactly those samples, and say why they differ (see `AccumulationReport`). Changes nothing."""
    ga = next((cb for cb in learn.cbs if isinstance(cb, GradientAccumulation)), None)
    bna = next((cb for cb in learn.cbs if isinstance(cb, BatchNormAccumulation)), None)
    mb = micro_batching(learn)
    size,note = (mb.size if mb is not None else None),''
    if n_step is None:
        n_step = 4
        if ga is not None:
            try: n_step = ga.window_n_step
            except Exception: pass
            bs = getattr(learn.dls.train, 'bs', None)
            if mb is not None and mb.auto and isinstance(bs, int) and bs >= 2 and (size is None or size >= bs):
                # 'auto' has not cut a loader batch yet: checking one uncut batch against itself would say nothing.
                # Check what its first out-of-memory error would run: each loader batch cut at the halved size
                size = halved(bs)
                n_step = n_step*n_pieces(bs, size)
                note = f"micro_bs='auto' has not cut a batch yet: checked at {size}, what its first halving runs"
    n_step = whole_number(n_step, 'n_step')
    if n_step == 1 and not note: note = "one micro-batch against itself: nothing is accumulated (pass n_step >= 2 to check a window)"
    if is_fsdp(learn.model):
        raise ValueError("check_accumulation: the model is sharded with FSDP2; run the check before sharding it (on one "
                         "process), or under DDP, where each rank checks its own samples")
    with rngs_kept():
        batches,where,dl = micro_batches(learn, n_step, size)
        rep = _check(learn, batches, training_model(learn, bna), ga, bna, n_step, where, dl)
    rep.note = note
    return rep

def _check(learn, batches, model, ga, bna, n_step, where, dl=None)->AccumulationReport:
    r = Experiments(learn, batches, model, ga, bna, where, dl)
    sizes = [find_bs(b) for b in batches]
    acc,fa,names,psizes = r.grads(True)
    # judged at the precision training really runs in: the model's (or autocast's), or the loss's where coarser
    dtype = max((r.dtype, r.loss_dtype or r.dtype), key=lambda d: _TOL.get(d, 1e-5))
    tol = _TOL.get(dtype, 1e-5)
    ref = 'device'
    try: big,fb,*_ = r.grads(False)
    except Exception as e:   # the big batch does not fit where the micro-batches do: compute it on the CPU
        if not is_out_of_memory(e): raise
        r.model0,r.model = copy_module(r.model0).cpu(),None
        r.batches = [to_device(b, 'cpu') for b in r.batches]; r.buffers = []; r.stateful = True
        try: big,fb,*_ = r.grads(False)
        except Exception as e:
            if not is_out_of_memory(e): raise
            raise RuntimeError(f"check_accumulation: one batch of the {sum(sizes)} items of n_step={n_step} micro-batches "
                               "runs out of memory on the device and on the CPU: pass a smaller `n_step`") from None
        big = big.to(acc.device); ref = 'cpu'
    err = _rel(acc, big)
    rep = AccumulationReport(exact=bool(fa and fb and err <= tol), rel_error=err, tol=tol, dtype=str(dtype).replace('torch.', ''),
                             n_step=n_step, micro_sizes=sizes, worst=_worst(names, psizes, acc, big, tol), reference=ref)
    # BatchNorm recomputed in the backward (checkpointing) counts its statistics twice: named, exact gradient or not
    recount = r.recomputed_bn and not (bna is not None and bna.mode in ('pool', 'momentum', 'freeze', 'groupnorm', 'window', 'window-approx'))
    if rep.exact:
        if recount: rep.causes,rep.advice = ('checkpoint',),{'checkpoint': CAUSE_ADVICE['checkpoint']}
        return rep
    causes,errors = (['checkpoint'] if recount else []),{}
    if not (fa and fb):
        causes.append('nonfinite'); errors['nonfinite'] = math.inf
    else:
        # a model that mixes the samples of a batch, or carries state from one loader batch to the next
        quiet,quiet_preds = r.outputs(r.exp, bn=False, drop=False)
        if quiet > tol: causes.append('not_per_sample'); errors['not_per_sample'] = quiet
        # BatchNorm and dropout, each switched on alone on the halves of the first micro-batch (where the parts and the
        # whole compute the same otherwise): a difference well above that of the quiet run is theirs
        quiet_clean = r.outputs(r.clean, bn=False, drop=False)[0] if r.clean != r.exp else quiet
        has_bn = any(isinstance(m, BatchNormBase) for m in model.modules()) and not (bna is not None and bna.mode == 'freeze')
        if has_bn:
            e = r.outputs(r.clean, bn=True, drop=False)[0]
            if e > max(tol, 10*quiet_clean): causes.append('batchnorm'); errors['batchnorm'] = e
        # does training mode change what training uses (the output or the gradient), BatchNorm quiet?
        train_mode,random_,state = r.train_effects(r.clean)
        def train_causes(e):
            "Which layers acting otherwise in training: drawn masks (dropout), or buffers a forward changes (spectral_norm)"
            for c,on in (('dropout', random_), ('train_state', state)):
                if on: causes.append(c); errors[c] = e
            return random_ or state
        if train_mode:
            # do the parts differ from the whole in training mode: their outputs, or their gradients?
            bar = max(tol, 10*quiet_clean, 10*r.train_split(r.clean, False))
            e = max(r.outputs(r.clean, bn=False, drop=True)[0], r.train_split(r.clean, True))
            for d in range(1, 5):   # (a rare drop may draw the same "nothing" for the parts and the whole: other draws)
                if e > bar or not random_: break
                e = r.train_split(r.clean, True, d)
            if e > bar and not train_causes(e): causes.append('unexplained'); errors['unexplained'] = e
        mean_err,sum_err = r.loss_split(quiet_preds)
        if mean_err > tol:
            c = 'loss_not_mean' if sum_err <= tol else 'n_items'
            causes.append(c); errors[c] = mean_err
        if r.adds_loss_terms:   # AR/TAR over padded positions: the difference goes with the terms
            with_terms,without = r.regularizer()
            if with_terms > max(tol, 10*without): causes.append('regularizer'); errors['regularizer'] = with_terms
        if not [c for c in causes if c != 'checkpoint']:   # before calling it unexplained: samples mixed anywhere in
            whole = r.outputs(r.window, bn=False, drop=False)[0] if r.window != r.exp else quiet   # the window? training mode?
            if whole > tol: causes.append('not_per_sample'); errors['not_per_sample'] = whole
            elif not (train_mode and train_causes(err)): causes.append('unexplained'); errors['unexplained'] = err
    rep.causes = tuple(c for c in CHECK_CAUSES if c in causes)
    rep.errors = {c: errors[c] for c in rep.causes if c in errors}
    rep.advice = {c: CAUSE_ADVICE[c] for c in rep.causes}
    return rep

@patch
def check_accumulation(self:Learner,
    n_step:int|None=None, # micro-batches to accumulate (default: the window of the Learner's GradientAccumulation, else 4; see the docs for 'auto')
)->AccumulationReport:
    """Is the gradient this Learner accumulates over `n_step` micro-batches of its training loader the gradient of one
    batch of exactly those samples? If not, why (`AccumulationReport.causes`)? Works on a copy: changes nothing"""
    return _run_check(self, n_step)

def check_accumulation(   # the module-level name (the @patch above put the method on Learner)
    learn:Learner, # the Learner to check, with its GradientAccumulation / BatchNormAccumulation / MixedPrecision
    n_step:int|None=None, # micro-batches to accumulate (default: the window of the Learner's GradientAccumulation, else 4; see the docs for 'auto')
)->AccumulationReport:
    "`learn.check_accumulation(n_step)` as a function"
    return _run_check(learn, n_step)
