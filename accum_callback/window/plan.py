"""The window plan: how large a window is (its schedule: `n_step` micro-batches or `target_bs` items), which unit closes
it (`schedule.decide`), the schedule's clock in windows (`schedule.WindowClock`) and the step's learning-rate gain.
`GradientAccumulation` asks it once a unit (a micro-batch, or with `micro_bs` a loader batch cut into micro-batches)"""
from __future__ import annotations
import math

from ..core.distributed import is_distributed, process_count
from .global_window import check_fastai_sharding, check_window_share, global_samples, shard_by_window
from ..core.loaders import batch_sizes
from .schedule import WindowClock, WindowSchedule, decide, window_arguments
from ..core.args import flag

__all__ = ['WindowPlan', 'Padding']

class WindowPlan:
    "The window's size and rule, from `GradientAccumulation`'s window arguments (checked at construction)"
    def __init__(self, n_step=None, target_bs=None, partial=None, global_window:bool=False):
        """`global_window`: `target_bs` counts the samples of all ranks together, each window the same on any number of
        them"""
        self.n_step,self.target_bs,self.partial = window_arguments(n_step, target_bs, partial)
        self.global_window = flag(global_window, 'global_window')
        if global_window and (self.target_bs is None or self.target_bs.constant is None):
            raise ValueError("GradientAccumulation(global_window=True) keeps a window of `target_bs` samples over all "
                             f"ranks: give target_bs as a number (got n_step={n_step!r}, target_bs={target_bs!r})")
        if global_window and self.partial == 'carry':   # its grid restarts each epoch, one process's does not
            raise ValueError("GradientAccumulation(global_window=True, partial='carry'): a window carried into the "
                             "next epoch is not cut alike on another number of processes; give partial='step' (the "
                             "default) or 'drop'")
        self.clock,self.decided = WindowClock(),0   # `decided`: the last loader batch decided (`MicroBatching`)
        self.dealt = None   # a `global_window` fit on several processes: the `WindowShardDL` that deals the windows

    @property
    def sched(self)->WindowSchedule: "The window's schedule"; return self.n_step or self.target_bs
    @property
    def by_items(self)->bool:
        "Is the window counted in items (`target_bs`) rather than micro-batches?"; return self.n_step is None

    @property
    def ranks(self)->int:
        "Ranks a window's `target_bs` is counted over: all of them with `global_window`, else 1"
        return process_count() if self.global_window else 1

    def units(self, target:int, bs:int)->int:
        "Units a full window of `target` (0: the schedule's now) takes on this rank at the loader's batch size `bs`"
        if not self.by_items: return target or self.n_step()
        return max(1, math.ceil((target or self.target_bs())/(bs*self.ranks)))

    def check_ranks(self, learn, cut:bool=False):
        """At fit start, before anything is set up: with `global_window` over several processes, can they share each
        window?"""
        dl = learn.dls.train
        if self.global_window and cut:
            raise ValueError("GradientAccumulation(global_window=True) deals whole loader batches to the ranks: "
                             "remove `MicroBatching` from the Learner")
        if not (self.global_window and process_count() > 1): return
        check_fastai_sharding(learn)
        check_window_share(self.target_bs(), process_count(), dl.bs, global_samples(dl), self.partial,
                           bool(getattr(dl, 'drop_last', False)))

    def loader(self, dl, model):
        "The training loader to read: with `global_window` under DDP, fastai's rank shares dealt again window by window"
        self.dealt = shard_by_window(dl, self.target_bs(),
                                     self.partial) if self.global_window and is_distributed(model) else None
        return self.dealt if self.dealt is not None else dl

    def dealt_unit(self, learn, w, padding)->str|None:
        """A dealt window's micro-batch (`global_window.deal`): its action, 'step' at the window's last (alike on every
        rank), or None; `padding` started where it is one (a copy run with zero weight: this rank holds fewer of the
        window's micro-batches)"""
        if not w.n_units: w.target = self.window_starts(learn)
        # (the clock counts the epoch's windows, one process's: this one is its last)
        pad,per = self.dealt.layout()[self.clock.j - 1]
        w.n_units += 1
        if w.n_units <= pad: padding.start(learn.model)
        return 'step' if w.n_units == per else None

    def next_unit(self, learn, w, piece, last:bool, bs:int, ddp:bool, padding)->str|None:
        """The action of the micro-batch starting in window `w`: 'step' or 'drop' where it closes the window, else None.
        A micro-batch is a loader batch (`piece` None: `last`, is it the epoch's last), a piece of one (`micro_bs`: the
        loader batch decides once, a retried piece keeps it, its last piece acts) or a dealt one (`global_window` on
        several processes: from the layout, `padding` started where it is one)"""
        if self.dealt is not None: return self.dealt_unit(learn, w, padding)
        if piece is None:
            if not w.n_micro: w.target = self.window_starts(learn)
            return self.decide(learn, w.target, bs, w.n_micro, w.n_samples, last, ddp)
        if self.decided != piece.serial:
            if not w.n_units: w.target = self.window_starts(learn)
            w.unit_action = self.decide(learn, w.target, piece.batch_n, w.n_units, w.n_samples, piece.last_batch, ddp)
            w.n_units += 1; self.decided = piece.serial
        return w.unit_action if piece.last_piece else None

    def micro_batches(self, window, bs:int|None, mb=None)->int:
        """Micro-batches a full window takes now: its units at loader batch size `bs`, each cut by `mb`
        (`MicroBatching`) where it cuts"""
        bs = bs or window.bs or 1   # (a loader of ready-made batches has no bs)
        k = self.units(window.target, bs)
        return k*mb.pieces(bs) if mb is not None and mb.size else k

    def decide(self, learn, target:int, b:int, units:int, seen:int, last:bool, ddp:bool)->str|None:
        """'step', 'drop' or None (the window stays open) for a unit of `b` items after `units` units and `seen` items.
        DDP: every rank must decide alike before the forward pass, so items are counted at the loader's batch size
        (a rank's short last batch would otherwise close its window later than the other ranks')"""
        if ddp: seen,b = units*learn.dls.train.bs*self.ranks,learn.dls.train.bs*self.ranks
        return decide(b, units, seen, target, self.by_items, last, self.partial, learn.epoch >= learn.n_epoch-1)

    def start_epoch(self, learn, dl, units:int, seen:int, ddp:bool):
        """An epoch of `dl`'s real batches starts (`units`/`seen`: a window carried in): the clock counts its windows
        (once an epoch: `clock.epoch`)"""
        # (dealt: one process's loader, whose windows the clock counts)
        sizes = (batch_sizes(self.dealt.dl) if self.dealt is not None else
                 [learn.dls.train.bs*self.ranks]*len(batch_sizes(dl)) if ddp else batch_sizes(dl))
        self.clock.start_epoch(learn.epoch, learn.n_epoch, sizes, self.sched, self.by_items, self.partial, units, seen)

    def window_starts(self, learn)->int:
        """A window starts: fastai's clock (`learn.pct_train`) set to the large batch's step it stands for; returns the
        window's size from the schedule at that point"""
        if (pct := self.clock.window_starts()) is not None: learn.pct_train = pct
        return self.sched(learn.pct_train, learn.epoch)

    def step_hypers(self, window, cut:bool, shared_bs:int|None, opt)->list|None:
        """The hyper-parameters of `window`'s step: the learning rate times the schedule's `lr_gain` for the window's
        size in the schedule's unit (loader batches where `cut`), alike on every rank (`shared_bs`: DDP's loader batch
        size, at which its micro-batches are counted)"""
        if not window.hypers: return window.hypers
        units = window.n_units if cut else window.n_micro
        items = window.n_micro*shared_bs*self.ranks if shared_bs else window.n_samples
        g = self.sched.lr_gain(items if self.by_items else units, opt)
        return window.hypers if g == 1. else [{**h, 'lr': h['lr']*g} if 'lr' in h else h for h in window.hypers]

    def state_dict(self)->dict: return dict(clock=dict(vars(self.clock)), decided=self.decided)
    def load_state_dict(self, sd:dict):
        "`ValueError` for a clock or a place that is not this plan's (its fields and their kinds), nothing set then"
        clock,now = sd['clock'],vars(self.clock)
        if (not isinstance(clock, dict) or set(clock) != set(now) or type(sd['decided']) is not int
                or not all(v is None or type(v) in (int, float) for v in clock.values())):
            raise ValueError(f"a window plan's state {sd!r:.120}: not a plan this package wrote")
        self.clock.__dict__.update(clock); self.decided = sd['decided']

class Padding:
    """A padding micro-batch in progress (`WindowPlan.dealt_unit`): every module in eval mode, so that BatchNorm neither
    normalises with it nor updates its statistics from it (its weight is zero), each module's mode put back after"""
    def __init__(self): self.modes = None
    @property
    def on(self)->bool: "Is the micro-batch in progress padding?"; return self.modes is not None
    def start(self, model): self.modes = [(m, m.training) for m in model.modules()]; model.eval()
    def end(self):
        if self.modes is None: return
        for m,t in self.modes: m.training = t
        self.modes = None
