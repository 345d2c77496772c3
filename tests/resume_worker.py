"""Runs for tests/test_resume.py: one configuration's fit, uninterrupted, and again killed with SIGKILL at given points
and resumed (`Checkpoint`) until it finishes. Each run is a forked child of this process (torch and fastai imported
once), killed by itself at its point: a training event of a numbered micro-batch, or in the middle of a checkpoint's
write. `python tests/resume_worker.py CONFIG OUT POINTS_JSON` writes OUT/result.pt: the final states of both."""
from __future__ import annotations
import json, os, signal, sys, warnings
from pathlib import Path

import torch, torch.nn as nn
from torch.utils.data import TensorDataset

torch.set_num_threads(1)
from fastai.callback.core import Callback
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.learner import Learner
from fastai.optimizer import SGD, Adam
from fastai.torch_core import set_seed
from fastai.callback.schedule import fit_one_cycle, fine_tune  # noqa: F401  (patches Learner)

import accum_callback.resume.checkpoint as C
from accum_callback import BatchNormAccumulation, Checkpoint, GradientAccumulation, GradientNoiseScale, MicroBatching
from accum_callback.testing import OutOfMemoryAbove, regression_data

EVENTS = ('before_batch', 'after_pred', 'after_backward', 'before_step', 'after_step', 'after_batch', 'in_save', 'sigterm_after_backward')

class BNNet(nn.Module):
    "An MLP with BatchNorm and dropout (state in the buffers, randomness in the forward)"
    def __init__(self, n_in=5, n_out=3):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n_in, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, n_out))
    def forward(self, x): return self.body(x)

class KillAt(Callback):
    """SIGKILL this process at `event` of the `at`-th training micro-batch (counting from 1 in this process), before
    the callbacks of ours (which cancel a `before_step` that does not close its window)"""
    order = -20
    def __init__(self, event, at): self.event,self.at,self.k = event,at,0
    def before_batch(self):
        if self.training: self.k += 1
        self._maybe('before_batch')
    def after_pred(self): self._maybe('after_pred')
    def after_backward(self): self._maybe('after_backward')
    def before_step(self): self._maybe('before_step')
    def after_step(self): self._maybe('after_step')
    def after_batch(self): self._maybe('after_batch')
    def _maybe(self, e):
        if not (self.training and self.k == self.at): return
        if e == self.event: os.kill(os.getpid(), signal.SIGKILL)
        if self.event == f'sigterm_{e}': os.kill(os.getpid(), signal.SIGTERM)   # the preemption notice: saved, then exit 143

def _kill_in_save(n:int):
    "The `n`-th checkpoint write of this process is cut after half its bytes, by SIGKILL"
    orig,count = C._write,[0]
    def write(path, obj):
        count[0] += 1
        if count[0] < n: return orig(path, obj)
        import io, tempfile
        buf = io.BytesIO(); torch.save(obj, buf); data = buf.getvalue()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd,tmp = tempfile.mkstemp(dir=path.parent, prefix=f'.{path.name}.', suffix=f'.{os.getpid()}.part')
        os.write(fd, C._MAGIC + data[:len(data)//2]); os.fsync(fd)
        os.kill(os.getpid(), signal.SIGKILL)
    C._write = write

def learner(config:str, folder:Path, extra=()):
    set_seed(0)
    ds = regression_data(60, seed=1)
    valid = regression_data(16, seed=2)
    dls = DataLoaders(DataLoader(ds, bs=8, shuffle=True, drop_last=False), DataLoader(valid, bs=8), device='cpu')
    cbs,loss,opt = [],nn.functional.mse_loss,SGD
    ckpt = dict(every=('1ep', '2ba'))
    if config == 'n_step': cbs = [GradientAccumulation(n_step=3)]
    elif config == 'carry_pool':
        cbs = [GradientAccumulation(target_bs=20, partial='carry'), BatchNormAccumulation('pool', precise=24)]; opt = Adam
    elif config == 'noise':
        noise = GradientNoiseScale(beta=0.5)
        cbs = [noise, GradientAccumulation(target_bs=noise.schedule(warmup=1, hi=40))]
    elif config == 'auto_oom':
        loss = OutOfMemoryAbove(5)
        cbs = [GradientAccumulation(n_step=2), MicroBatching('auto')]
    elif config == 'momentum': cbs = [GradientAccumulation(n_step=3), BatchNormAccumulation('momentum')]; opt = Adam
    learn = Learner(dls, BNNet(), loss_func=loss, opt_func=opt, lr=1e-2,
                    cbs=cbs + [Checkpoint(folder, **ckpt)] + list(extra))
    return learn

def run(config:str, folder:Path, meth:str, extra=()):
    learn = learner(config, folder, extra)
    with learn.no_logging(), warnings.catch_warnings():   # (fastai's progress bar on, as users run it)
        warnings.simplefilter('ignore')
        if meth == 'fit_one_cycle': learn.fit_one_cycle(3, 1e-2)
        elif meth == 'fine_tune': learn.fine_tune(2, 1e-2, freeze_epochs=1)
        else: learn.fit(3)
    opt = learn.opt.state_dict()
    return dict(model={k: v.clone() for k,v in learn.model.state_dict().items()},
                opt=[{k: v for k,v in s.items() if isinstance(v, torch.Tensor)} for s in opt['state']],
                losses=[float(l) for l in learn.recorder.losses], values=[list(map(float, v)) for v in learn.recorder.values],
                steps=learn.gradient_accumulation.steps)

def forked(fn, out:Path):
    "Run `fn()` in a forked child; returns its exit status (-9: killed) and what it returned"
    pid = os.fork()
    if pid == 0:
        try:
            res = fn()
            torch.save(res, out/f'res-{os.getpid()}.pt')
            os._exit(0)
        except SystemExit as e: os._exit(e.code if isinstance(e.code, int) else 1)   # (SIGTERM: saved, then 143)
        except KeyboardInterrupt: os._exit(130)
        except BaseException as e:
            import traceback; traceback.print_exc(); os._exit(3)
    _,status = os.waitpid(pid, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    f = out/f'res-{pid}.pt'
    res = torch.load(f, weights_only=False) if code == 0 else None
    if f.exists(): f.unlink()
    return code,res

def main(config:str, out:str, points:list, meth:str='fit'):
    out = Path(out); out.mkdir(parents=True, exist_ok=True)
    code,ref = forked(lambda: run(config, out/'ref', meth), out)
    assert code == 0, f'the uninterrupted run failed ({code})'
    kills = []
    for event,at in points:
        def one(event=event, at=at):
            if event == 'in_save': _kill_in_save(at); return run(config, out/'cut', meth)
            return run(config, out/'cut', meth, extra=[KillAt(event, at)])
        code,res = forked(one, out)
        kills.append((event, at, code))
        if code == 0: break   # (a point past the run's end: it finished)
    code,final = forked(lambda: run(config, out/'cut', meth), out)
    assert code == 0, f'the last resumed run failed ({code})'
    torch.save(dict(ref=ref, final=final, kills=kills), out/'result.pt')

if __name__ == '__main__':
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), *(sys.argv[4:5] or []))

# -- distributed: each rank its shard, its loader order and its RNGs ---------------------------------------------------
class _Cut(Exception): pass

class CutAt(Callback):
    "Raise `_Cut` at the end of the `at`-th training micro-batch, on every rank alike (the job dies there)"
    order = 99
    def __init__(self, at): self.at,self.k = at,0
    def after_batch(self):
        if self.training:
            self.k += 1
            if self.k == self.at: raise _Cut('cut')

def ranks_resume(rank:int, world:int, d:str, kind:str='ddp', at:int=5):
    """The same 2-epoch fit on every rank's shard: uninterrupted, then cut at micro-batch `at` and run again. Returns
    whether this rank's weights (its shard under FSDP2), optimizer state and Recorder are bitwise the uninterrupted run's"""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from ddp_worker import MLP, fsdp_shard
    def mk(folder, extra=()):
        set_seed(0)   # the same initial weights on every rank
        x,y = regression_data(64, seed=1).tensors
        model = MLP(n_in=5, n_out=3, seed=0)
        set_seed(10 + rank)   # each rank's loader its own order
        dls = DataLoaders(DataLoader(TensorDataset(x[rank::world], y[rank::world]), bs=4, shuffle=True),
                          DataLoader(TensorDataset(x[:8], y[:8]), bs=8), device='cpu')
        learn = Learner(dls, model, loss_func=nn.functional.mse_loss, opt_func=Adam, lr=1e-2,
                        cbs=[GradientAccumulation(n_step=3), Checkpoint(Path(d)/folder, every=('1ep', '2ba'))] + list(extra))
        if kind == 'ddp': learn.model = DDP(model)
        else: fsdp_shard(model, world); learn.create_opt(); learn.fsdp_checkpoints()
        return learn
    def fit(learn):
        with learn.no_logging(), warnings.catch_warnings():   # (fastai's progress bar on, as users run it)
            warnings.simplefilter('ignore'); learn.fit(2)
    def state(learn):
        m = learn.model.module if kind == 'ddp' else learn.model
        loc = lambda t: t.to_local() if hasattr(t, 'to_local') else t
        return ([loc(v).clone() for v in m.state_dict().values()],
                [loc(v).clone() for s in learn.opt.state_dict()['state'] for v in s.values() if isinstance(v, torch.Tensor)],
                [float(l) for l in learn.recorder.losses], learn.gradient_accumulation.steps)
    ref = mk('ref'); fit(ref); a = state(ref)
    cut = mk('cut', [CutAt(at)])
    try: fit(cut); raise AssertionError('the cut did not happen')
    except _Cut: pass
    again = mk('cut'); fit(again); b = state(again)
    resumed = again.cbs.filter(lambda c: isinstance(c, Checkpoint))[0].resumed_from
    return dict(rank=rank, resumed=str(resumed), model=all(torch.equal(x, y) for x,y in zip(a[0], b[0])),
                opt=len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x,y in zip(a[1], b[1])),
                losses=a[2] == b[2], steps=(a[3], b[3]))
