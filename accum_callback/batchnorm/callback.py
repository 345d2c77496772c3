"""BatchNorm under gradient accumulation: `BatchNormAccumulation` and its modes (pooled running statistics, the momentum
rule, frozen statistics, conversion to GroupNorm or Batch Renorm), each a small strategy class in `MODES`"""
from __future__ import annotations
import contextlib, warnings

from fastai.callback.core import Callback
from fastai.callback.fp16 import MixedPrecision
from fastai.callback.training import GradientAccumulation as FastaiGradientAccumulation

from ..window.accumulate import GradientAccumulation
from ..compat.torch import is_compiled
from ..micro import micro_batching, micro_size
from .precise import training_items, update_bn_stats
from ..core.distributed import fsdp_modules, process_count, sync_batchnorm_world
from ..core.protocols import (CANCELS, ResumeSignature, RunningStatsPolicy, SaysPickled, add_fit_guard, in_inference,
                              one_per_learner, refuse_at_fit_start, remove_fit_guard, user_stacklevel)
from .modes import BN_MODES, BN_OPTIONS, Freeze, Groups, Renorm
from .norm_layers import BatchRenorm, bn_to_batchrenorm, bn_to_groupnorm, is_batchnorm, is_converted_norm, set_norm_mode
from .window_stats import WINDOW_MODES, WindowMode
from .pool import PooledStats, RecomputeGuard, accumulated_momentum, pooled_mean_var   # (re-exported)
from ..core.args import whole_number

__all__ = ['BatchNormAccumulation', 'BN_MODES', 'MODES', 'accumulated_momentum', 'pooled_mean_var', 'PooledStats',
           'RecomputeGuard']

# -- modes: what BatchNormAccumulation does at the start of fit, per micro-batch, per window and at the end -----------
class _Mode:
    needs_windows = False   # reads GradientAccumulation's windows
    def __init__(self, cb): self.cb = cb
    def start(self, bns): pass
    def micro_undone(self): pass   # micro_bs='auto' undid a micro-batch that ran out of memory
    def before_train(self): pass
    def before_batch(self): pass
    def before_backward(self): pass
    def after_backward(self): pass
    def window_closed(self, stepped:bool): pass
    def restore(self): pass
    def state(self): return None
    def load_state(self, st): pass

class Pool(_Mode):
    "'pool': one running-statistics update per optimizer step, from every micro-batch of the window (`PooledStats`)"
    needs_windows = True
    def start(self, bns):
        bns = [bn for bn in bns if bn.running_mean is not None]   # no running statistics to pool
        self.saved = [(bn, bn.momentum) for bn in bns]
        self.banks,self.handles = [],[]
        groups = {}
        for bn in bns: groups.setdefault((bn.running_mean.device, bn.running_mean.dtype), []).append(bn)
        cap,staged = self.cb.ga.window_n_step,is_compiled(self.cb.learn.model)
        # a `global_window` run's window is the same samples on any number of processes: pooled over all ranks (not for
        # SyncBatchNorm, whose statistics cover all ranks already), so its running statistics are one process's
        ranks = self.cb.ga is not None and self.cb.ga.window_over_ranks and process_count() > 1
        for g in groups.values():
            bank = PooledStats(g, [bn.momentum for bn in g], cap, staged,
                               ranks and all(sync_batchnorm_world(bn) == 1 for bn in g))
            for l,bn in enumerate(g):
                pre,post = bank.hooks(l)
                self.handles += [bn.register_forward_pre_hook(pre), bn.register_forward_hook(post)]
            self.banks.append(bank)
        for b in self.banks:   # the forward writes exactly that micro-batch's mean and unbiased variance (staged: the
            for bn in b.bns:     # hook does, and the layer leaves its running buffers as they are)
                bn.momentum = 0. if b.staged and sync_batchnorm_world(bn) == 1 else 1.
        self.guard = RecomputeGuard(bns)
    def before_batch(self):
        self._in_backward(False)   # (a backward that raised did not reach `after_backward`)
        for b in self.banks: b.end_micro(False)   # statistics of a micro-batch cancelled before its backward
    def before_backward(self): self._in_backward(True)
    def after_backward(self):
        self._in_backward(False)
        counted = self.cb.ga.window.counted   # another callback may have cancelled the backward: then nothing pools
        for b in self.banks: b.end_micro(counted)
    def _in_backward(self, on:bool):
        "A forward during the backward recomputes activations (checkpointing): the guard takes it, the banks do not"
        self.guard.start() if on else self.guard.stop()
        for b in self.banks: b.paused = on
    def window_closed(self, stepped:bool):
        for b in self.banks: b.close(stepped)
    def state(self): return [b.state() for b in self.banks]
    def load_state(self, st):
        for b,s in zip(self.banks, st): b.load_state(s)
    def micro_undone(self):
        for b in self.banks: b.restore_buffers(); b.end_micro(False)
    def restore(self):
        if getattr(self, 'guard', None) is not None: self._in_backward(False); self.guard.remove()
        for h in getattr(self, 'handles', ()): h.remove()
        for b in getattr(self, 'banks', ()):
            b.restore_buffers()
            if b.staged: b.fix_nbt()   # (the forwards of a window that did not step counted too)
        for bn,m in getattr(self, 'saved', ()): bn.momentum = m
        self.handles,self.banks,self.saved = [],[],[]

class Momentum(_Mode):
    "'momentum': each BatchNorm momentum m becomes `accumulated_momentum(m, k)`, k micro-batches per window"
    needs_windows = True
    def start(self, bns):
        self.saved,self.k = [(bn, bn.momentum) for bn in bns if bn.momentum is not None],None
        self.guard = RecomputeGuard(bns)
    def before_backward(self): self.guard.start()
    def after_backward(self): self.guard.stop()
    def before_batch(self):
        self.guard.stop()   # (a backward that raised did not reach `after_backward`)
        ga = self.cb.ga
        if not (self.saved and ga.window_start): return
        k = ga.window_n_step
        if k != self.k:
            self.k = k
            for bn,m in self.saved: bn.momentum = accumulated_momentum(m, k)
    def restore(self):
        if getattr(self, 'guard', None) is not None: self.guard.remove()
        for bn,m in getattr(self, 'saved', ()): bn.momentum = m
        self.saved = []
    def state(self): return dict(k=self.k)
    def load_state(self, st):
        self.k = st['k']
        if self.k is not None:
            for bn,m in self.saved: bn.momentum = accumulated_momentum(m, self.k)

class Frozen(_Mode):
    "'freeze': BatchNorm layers normalise with their running statistics in training too (`Freeze`)"
    def start(self, bns):
        self.frozen,self.saved_rg = bns,[]
        if not self.cb.options.train_affine:
            ps = [p for bn in bns for p in (bn.weight, bn.bias) if p is not None]
            self.saved_rg = [(p, p.requires_grad) for p in ps]
            for p in ps: p.requires_grad_(False)
        if any(bn.running_mean is None for bn in bns):
            warnings.warn("BatchNormAccumulation('freeze'): BatchNorm layers with track_running_stats=False have no "
                          "running statistics and keep normalising with batch statistics", stacklevel=user_stacklevel())
    def before_train(self):
        # after `TrainEvalCallback` put the whole model in train mode; the layers' own mode only (a timm norm-act
        # layer's DropBlock and activation train as they would without this callback)
        for bn in self.frozen: set_norm_mode(bn, False)
    def restore(self):
        for p,rg in getattr(self, 'saved_rg', ()): p.requires_grad_(rg)
        # the mode the training loop left the model in (eval after validation), as it would be without this callback
        model = getattr(self.cb.learn, 'model', None)
        for bn in getattr(self, 'frozen', ()): set_norm_mode(bn, model.training if model is not None else bn.training)
        self.frozen,self.saved_rg = [],[]

class _Convert(_Mode):
    "Replace the BatchNorm layers at the start of fit (the Parameter objects are kept: the optimizer keeps working)"
    def convert(self, model): raise NotImplementedError
    def start(self, bns):
        new = self.convert(self.cb.model)
        if new is not self.cb.model: self.cb.learn.model = new   # the root itself was a BatchNorm

class ToGroupNorm(_Convert):
    "'groupnorm': BatchNorm layers become GroupNorm (`bn_to_groupnorm`, `Groups`)"
    def convert(self, model):
        with warnings.catch_warnings():   # the mode's documented effect, not news to the user who chose it
            warnings.filterwarnings('ignore', message='bn_to_groupnorm: running statistics', category=UserWarning)
            return bn_to_groupnorm(model, self.cb.options.num_groups)

class ToRenorm(_Convert):
    "'renorm': BatchNorm layers become `BatchRenorm` (`bn_to_batchrenorm`, `Renorm`)"
    def convert(self, model):
        o = self.cb.options
        return bn_to_batchrenorm(model, r_max=o.r_max, d_max=o.d_max, warmup=o.warmup, ramp=o.ramp)

MODES = dict(pool=Pool, momentum=Momentum, freeze=Frozen, groupnorm=ToGroupNorm, renorm=ToRenorm)
MODES.update({m: WindowMode for m in WINDOW_MODES})   # the window's own statistics in training (`window_stats`)
assert tuple(MODES) == BN_MODES
PRECISE_AT = ('epoch', 'end')   # when `precise` recomputes the statistics

# 0.2's keywords of a mode's options, now given with the mode
_MOVED = dict(train_affine=Freeze, num_groups=Groups, r_max=Renorm, d_max=Renorm, warmup=Renorm, ramp=Renorm)

def _refuse_moved(kw:dict):
    "A keyword that 0.3 moved into the mode's options object: a TypeError spelling the call as 0.3 takes it"
    if (bad := next((k for k in kw if k not in _MOVED), None)) is not None:
        raise TypeError(f"BatchNormAccumulation.__init__() got an unexpected keyword argument {bad!r}")
    by = {}
    for k,v in kw.items(): by.setdefault(_MOVED[k].__name__, []).append(f'{k}={v!r}')
    old = ', '.join(f'{k}={v!r}' for k,v in kw.items())
    new = ' or '.join(f"mode={c}({', '.join(a)})" for c,a in by.items())
    raise TypeError(f"`{old}` is `{new}` since 0.3 (`from accum_callback import {', '.join(by)}`)")

def _mode_and_options(mode)->tuple:
    "`mode` as its name and its options object (the defaults for a name; None for a mode without options)"
    if isinstance(mode, type) and mode in BN_OPTIONS.values():
        raise ValueError(f"`mode`: give the options object, `{mode.__name__}()`, not its class")
    if isinstance(mode, tuple(BN_OPTIONS.values())): return mode.name,mode
    if not isinstance(mode, str) or mode not in BN_MODES:
        raise ValueError(f"`mode` must be one of {BN_MODES} or a mode's options (Freeze(...), Groups(...), "
                         f"Renorm(...)), got {mode!r}")
    return mode,(BN_OPTIONS[mode]() if mode in BN_OPTIONS else None)

# -- the callback -----------------------------------------------------------------------------------------------------
@one_per_learner("(Each would convert, freeze or pool the same layers.)")
class BatchNormAccumulation(SaysPickled, Callback, RunningStatsPolicy, ResumeSignature):
    """Make BatchNorm behave under gradient accumulation. `mode`: one of `BN_MODES`, or the options object of a mode
    that takes options (`Freeze`, `Groups`, `Renorm`: `BatchNormAccumulation('renorm')` is
    `BatchNormAccumulation(Renorm())`; `.mode` is the name, `.options` the object, None for a mode without options):
    'pool': one running-statistics update per optimizer step, from the statistics pooled over every micro-batch of the
      window: the running statistics one large batch of the same samples leaves. The forward still normalises each
      micro-batch with its own statistics (ghost batch norm). A window that is not stepped (dropped, skipped as
      non-finite, step cancelled) updates nothing; a layer called several times per forward pools all calls.
    'momentum': each BatchNorm momentum m becomes `accumulated_momentum(m, k)` during fit, k micro-batches per window.
    'freeze' (`Freeze(train_affine=True)`): BatchNorm layers use their running statistics in training too; affine
      parameters train if `train_affine`.
    'groupnorm' (`Groups(num_groups=32)`): BatchNorm layers become GroupNorm (`bn_to_groupnorm`) at the start of fit.
    'renorm' (`Renorm(r_max=3., d_max=5., warmup=0, ramp=5000)`): BatchNorm layers become `BatchRenorm`
      (`bn_to_batchrenorm`) at the start of fit.
    'window': every micro-batch is normalised with its whole window's statistics and its backward takes the window's
      sums (`window_stats`): each step's gradient and the running statistics are the large batch's; past
      `WINDOW_EXACT_MAX_LAYERS` layers the approximate variant ('window-approx': the backward's statistics terms from
      the micro-batch's own sums), said at fit start. A window is one loader batch cut by `MicroBatching(size)`.
    `precise=N` (any mode but 'freeze'): at the end of every training epoch (before validation, so at the end of fit
    too) every BatchNorm layer's running statistics are recomputed from N training items with the current weights,
    pooled exactly over the micro-batches and the ranks (`update_bn_stats`); nothing else changes (docs/batchnorm.md).
    `precise_at='end'`: at the last epoch's end only (and at the end of a fit cancelled before it), for a fraction of
    the cost where only the final model's statistics matter; earlier validations read the running statistics."""
    order,run_valid,_only_train_loop = GradientAccumulation.order+1,False,True   # reads `GradientAccumulation`'s window

    def __init__(self,
        mode:str|Freeze|Groups|Renorm='pool', # one of `BN_MODES`, or a mode's options: `Freeze`, `Groups`, `Renorm`
        *,
        # at the end of each training epoch, recompute the running statistics from this many training items with the
        # current weights (`update_bn_stats`)
        precise:int|None=None,
        # when: 'epoch' (every epoch's end, before its validation) or 'end' (the last epoch's only: earlier
        # validations read the running statistics)
        precise_at:str='epoch',
        **moved, # 0.2's `train_affine`, `num_groups`, `r_max`, `d_max`, `warmup`, `ramp`: refused, saying 0.3's
    ):
        if moved: _refuse_moved(moved)
        self.mode,self.options = _mode_and_options(mode)
        if precise is not None:
            whole_number(precise, 'precise')
            if self.mode == 'freeze': raise ValueError("`precise`: 'freeze' keeps the running statistics as they are, "
                                                       "and precise statistics would replace them: give one or the "
                                                       "other")
        if precise_at not in PRECISE_AT:
            raise ValueError(f"`precise_at` must be one of {PRECISE_AT}, got {precise_at!r}")
        self.precise,self.precise_at = precise,precise_at
        self.ga,self.active,self._warned = None,None,False

    @property
    def converts(self)->bool:
        "Does this mode replace the BatchNorm layers ('groupnorm', 'renorm')?"
        return issubclass(MODES[self.mode], _Convert)

    def convert(self, model):
        """The model as this mode trains it: its BatchNorm layers replaced for 'groupnorm'/'renorm' (in place, the
        Parameter objects kept; a new root only where the root is a BatchNorm), `model` itself for the other modes.
        `learn.check_accumulation()` converts a copy with it, `learn.to_fsdp()` the model before sharding"""
        return MODES[self.mode](self).convert(model) if self.converts else model

    # -- fit --------------------------------------------------------------------------------------------------------
    def before_fit(self):
        # `validate`/`get_preds`/`predict` send `before_fit` too, holding the Learner's lock: no conversion, no hooks
        # and
        # no raise there (a raise would leave the lock held); everything happens when training starts
        if in_inference(self.learn): return
        refuse_at_fit_start(self.learn)   # (ours and the other callbacks of ours: before anything is set up)
        self._restore()   # whatever an interrupted fit left behind
        mode = MODES[self.mode]
        self.ga = next((cb for cb in self.learn.cbs if isinstance(cb, GradientAccumulation)), None)
        bns = [m for m in self.model.modules() if is_batchnorm(m)]
        if issubclass(mode, _Convert):
            if bns: mode(self).start(bns)
            elif not any(is_converted_norm(m) for m in self.model.modules()): self._warn_none()
            self._tag_norm_params()
            return
        if not bns: return self._warn_none()
        self.active = mode(self)
        self.active.start(bns)
        if mode.needs_windows:
            self.ga.on_window_close(self._window_closed)
            self.mb = micro_batching(self.learn)
            if self.mb is not None: self.mb.on_undo(self._micro_undone)
        add_fit_guard(self.learn, 'batch_norm_accumulation', lambda e: isinstance(e, CANCELS) or self._restore())

    def refuse_fit(self):
        """What this fit is refused for (`protocols.refuse_at_fit_start`): no windows to read, a conversion of a sharded
        model"""
        mode = MODES[self.mode]
        if hasattr(mode, 'refuse') and any(isinstance(cb, GradientAccumulation) for cb in self.learn.cbs):
            mode.refuse(self.learn, self.mode)
        if mode.needs_windows and not any(isinstance(cb, GradientAccumulation) for cb in self.learn.cbs):
            other = any(isinstance(cb, FastaiGradientAccumulation) for cb in self.learn.cbs)
            raise ValueError(f"BatchNormAccumulation(mode={self.mode!r}) reads the accumulation windows from "
                             "`accum_callback.GradientAccumulation`, which is not in this fit" +
                             (" (fastai's `fastai.callback.training.GradientAccumulation` is, and has no windows to "
                              "read)" if other else "") +
                             ": add `accum_callback.GradientAccumulation(n_step=...)` to the Learner's callbacks or to "
                             "this `fit(cbs=...)`, or call `learn.accumulate(...)`")
        if issubclass(mode, _Convert) and fsdp_modules(self.model) and any(is_batchnorm(m)
                                                                           for m in self.model.modules()):
            raise ValueError(f"BatchNormAccumulation(mode={self.mode!r}): the model is sharded with FSDP2, whose "
                             "parameter groups a conversion would break. Convert before sharding: `learn.to_fsdp()` "
                             "does it when this callback is on the Learner, or call "
                             f"`{'bn_to_groupnorm' if self.mode == 'groupnorm' else 'bn_to_batchrenorm'}(model)` "
                             "before `fully_shard`")

    def after_fit(self):
        if in_inference(self.learn): return
        if self.precise and not getattr(self, '_recomputed', True): self._recompute()   # a fit cancelled mid-epoch
        self._restore()

    def _recompute(self):
        "Precise statistics: `update_bn_stats` on `precise` training items, cut as the Learner's micro-batches"
        learn = self.learn
        mp = next((cb for cb in learn.cbs if isinstance(cb, MixedPrecision)), None)
        ctx = (lambda: mp.autocast) if getattr(mp, 'autocast', None) is not None else contextlib.nullcontext
        banks = getattr(self.active, 'banks', ())
        for bank in banks: bank.paused = True   # (what 'pool' collects is a training window's, not this)
        try: self.precise_items = update_bn_stats(learn.model, training_items(learn, self.precise, micro_size(learn),
                                                                            seed=getattr(learn, 'epoch', 0)), ctx=ctx)
        finally:
            for bank in banks: bank.paused = False
        self._recomputed = True

    def _warn_none(self):
        if not self._warned: warnings.warn(f"BatchNormAccumulation(mode={self.mode!r}): the model has no BatchNorm "
                                           "layer; nothing changed", stacklevel=user_stacklevel())
        self._warned = True

    def _restore(self):
        "Put back momentum, train/eval mode and requires_grad, remove the hooks and forget any window"
        if self.active is not None: self.active.restore()
        self.active = None
        if self.ga is not None: self.ga.remove_window_listener(self._window_closed)
        if getattr(self, 'mb', None) is not None: self.mb.remove_undo_listener(self._micro_undone); self.mb = None
        remove_fit_guard(self.learn, 'batch_norm_accumulation')

    def _tag_norm_params(self):
        """fastai picks BatchNorm parameters by type for `train_bn`/`wd_bn_bias`: give converted layers the same
        treatment"""
        opt = getattr(self.learn, 'opt', None)
        if opt is None: return
        ps = {id(p) for m in self.model.modules() if is_converted_norm(m) for p in m.parameters()}
        for p,_,state,_ in opt.all_params():
            if id(p) not in ps: continue
            if not getattr(self.learn, 'wd_bn_bias', False): state['do_wd'] = False
            if getattr(self.learn, 'train_bn', True) and not state.get('force_train'):
                state['force_train'] = True
                p.requires_grad_(True)

    # -- events -----------------------------------------------------------------------------------------------------
    def before_train(self):
        self._recomputed = False
        if self.active is not None: self.active.before_train()
    def after_train(self):
        # before validation: the epoch's model is validated with its own statistics ('end': the last epoch's only)
        if self.precise and (self.precise_at == 'epoch' or self.learn.epoch >= self.learn.n_epoch-1): self._recompute()
    def before_batch(self):
        if self.active is not None: self.active.before_batch()
    def before_backward(self):
        if self.active is not None: self.active.before_backward()
    def after_backward(self):
        if self.active is not None: self.active.after_backward()
    resume_keys = ('BatchNorm mode',)
    def resume_signature(self)->dict:
        "A resume must treat BatchNorm as this fit does"; return {'BatchNorm mode': self.mode}
    def keeps_running_stats(self)->bool:
        "'freeze' leaves the running statistics as they are"; return self.mode == 'freeze'
    def window_normalises(self)->bool:
        "'window' modes: a micro-batch of one item is normalised by its window"; return self.mode in WINDOW_MODES
    def pools_over_ranks(self)->bool:
        "'pool' pools a `global_window` run's window over all ranks (`PooledStats.over_ranks`)"
        return self.mode == 'pool'

    def state_dict(self)->dict:
        """What a window in progress holds ('pool': its micro-batches' statistics; 'momentum': the momenta in force),
        and each Batch Renorm layer's count of training forwards (it drives `r_max`/`d_max`'s ramp; not in the model's
        state dict)"""
        return dict(active=self.active.state() if self.active is not None else None,
                    recomputed=getattr(self, '_recomputed', True),
                    renorm_steps={n: m.renorm_steps for n,m in self._renorm_layers().items()})
    def load_state_dict(self, sd:dict):
        steps,layers = sd.get('renorm_steps', {}),self._renorm_layers()   # (a checkpoint of 0.3.0 has none)
        if not (isinstance(steps, dict) and all(n in layers and type(v) is int and v >= 0 for n,v in steps.items())):
            raise ValueError(f"BatchNormAccumulation: renorm_steps {steps!r:.120} do not fit this model's Batch Renorm "
                             "layers")
        if self.active is not None and sd['active'] is not None: self.active.load_state(sd['active'])
        self._recomputed = sd['recomputed']
        for n,v in steps.items(): layers[n].renorm_steps = v
    def _renorm_layers(self)->dict:
        learn = getattr(self, 'learn', None)
        return {n: m for n,m in learn.model.named_modules() if isinstance(m, BatchRenorm)} if learn is not None else {}
    def _window_closed(self, stepped:bool):
        "GradientAccumulation closed the window: stepped, or dropped/skipped/cancelled"
        if self.active is not None: self.active.window_closed(stepped)
    def _micro_undone(self):
        if self.active is not None: self.active.micro_undone()
