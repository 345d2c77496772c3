"""What `GradientAccumulation` records of each window of a fit (its public logs), their state for a checkpoint, and the
plot"""
from __future__ import annotations
import warnings
from ..core.protocols import user_stacklevel

__all__ = ['WindowLog', 'LOGS']

LOGS = ('window_sizes', 'window_items', 'window_losses', 'window_micro', 'n_skipped', 'n_dropped', 'n_step_cancelled')

class WindowLog:
    """The logs of the last (or current) fit's windows, kept on the callback: per optimizer step its samples
    (`window_sizes`), items (`window_items`), item-weighted mean loss (`window_losses`) and micro-batches
    (`window_micro`); windows skipped for a non-finite loss (`n_skipped`), dropped (`n_dropped`) and whose step another
    callback cancelled (`n_step_cancelled`)"""
    def reset_logs(self):
        self.window_sizes,self.window_items,self.window_losses,self.window_micro = [],[],[],[]
        self.n_skipped,self.n_dropped,self.n_step_cancelled = 0,0,0

    @property
    def steps(self)->int: "Optimizer steps taken in the last (or current) `fit`"; return len(self.window_sizes)

    def log_step(self, record):
        "A window stepped (`state.StepRecord`: its samples, items, loss and micro-batches)"
        self.window_sizes.append(record.samples); self.window_items.append(record.items)
        self.window_losses.append(record.loss); self.window_micro.append(record.micro)

    def warn_skipped(self):
        "Said at the end of a fit that dropped windows for a non-finite loss"
        if self.n_skipped:
            warnings.warn(f"GradientAccumulation: {self.n_skipped} window(s) dropped because a micro-batch gave a "
                          "non-finite loss", stacklevel=user_stacklevel())

    def logs_state(self)->dict: return {k: getattr(self, k) for k in LOGS}
    def load_logs(self, sd:dict):
        "The logs' names only (no other attribute a file names), each a list or a count as `logs_state` gives them"
        # (the lists; the rest counts)
        bad = next((k for k in LOGS if k in sd and not (isinstance(sd[k], list) if k.startswith('window_')
                                                        else type(sd[k]) is int and sd[k] >= 0)), None)
        if bad is not None: raise ValueError(f"a window log's {bad!r} is {sd[bad]!r:.80}: not a log this package wrote")
        for k in LOGS:
            if k in sd: setattr(self, k, sd[k])

    def plot_windows(self, ax=None):
        """Plot each optimizer step's item-weighted window loss against optimizer steps; returns the axes (a notebook
        shows the figure; a script: `plt.show()`, or `ax.figure.savefig(...)`, labels inside the saved figure)"""
        import matplotlib.pyplot as plt
        new = ax is None
        if new: _,ax = plt.subplots(figsize=(6,3.5))
        ax.plot(range(1, self.steps+1), self.window_losses)
        ax.set_xlabel('optimizer step'); ax.set_ylabel('window loss (item-weighted mean)')
        if new: ax.figure.tight_layout()
        return ax

    def plot_loss(self, recorder=None, ax=None):
        """fastai's `learn.recorder.plot_loss()` counted in optimizer steps rather than micro-batches: each step's
        window loss, and the validation loss of each epoch of `recorder` (the Learner's, by default) at the step it
        ended on"""
        import bisect, itertools
        ax = self.plot_windows(ax)
        ax.lines[0].set_label('train (window loss)')
        rec = recorder if recorder is not None else self.learn.recorder
        ends = list(itertools.accumulate(self.window_micro))   # micro-batches run by the end of each step
        valid = [(bisect.bisect_left(ends, it) + 1, v[1]) for it,v in zip(rec.iters, rec.values) if len(v) > 1]
        if valid: ax.plot(*zip(*valid), marker='o', label='valid')
        ax.set_ylabel('loss'); ax.legend()
        return ax
