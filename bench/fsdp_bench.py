"""FSDP2 modes of `GradientAccumulation`, side by side: collectives per optimizer step, time per step, and the gradient
memory each rank holds, in one run.

Two CPU processes over gloo train the same float32 MLP (`fully_shard` on each Linear, then the root), `n_step`
micro-batches per step:
- `sync every micro-batch` (`sharded_grads=True`): reduce-scatter after every backward, gradients stay sharded;
- `one reduce-scatter a window` (the default): no gradient sync until the window's last backward (FSDP2 holds the
  gradients unsharded until then);
- `+ gathered_params`: the default and the parameters kept gathered through the window (one all-gather a window).
Collectives are counted by wrapping `torch.distributed`'s functions (`count_collectives`); the held gradient bytes are
read after every backward (FSDP2's unsharded gradients plus the sharded `.grad`s); time is the training time per step,
modes alternating over `--repeats` rounds (mean and 95% interval of each mode's time over the sync-every mode's).

    python bench/fsdp_bench.py                   # defaults: n_step 4, 6 steps, hidden 1024 (~2.6M parameters)
"""
import argparse, sys, time, warnings
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import TensorDataset
from fastai.callback.core import Callback, CancelValidException
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.learner import Learner
from fastai.optimizer import SGD

from accum_callback import GradientAccumulation
from accum_callback.core.distributed import FSDPOptions, count_collectives, fsdp_group_count, held_grad_bytes
from common import launch_gloo, machine, mean_ci

MODES = {'sync every micro-batch': dict(sharded_grads=True), 'one reduce-scatter a window': dict(),
         '+ gathered_params': dict(gathered_params=True)}

class NoValid(Callback):
    def before_validate(self): raise CancelValidException()

class HeldGrads(Callback):
    "Peak gradient bytes this rank holds after a backward: FSDP2's unsharded ones plus the sharded `.grad`s"
    order = 100
    def before_fit(self): self.peak = 0
    def after_backward(self):
        self.peak = max(self.peak, sum(held_grad_bytes(self.learn.model)))

def run(rank, world, n_step, bs, steps, hidden, repeats, seed=0):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    warnings.filterwarnings('ignore')
    mesh = init_device_mesh('cpu', (world,))
    g = torch.Generator().manual_seed(seed+rank)
    n = n_step*steps*bs
    x,y = torch.randn(n, 512, generator=g),torch.randn(n, 10, generator=g)
    def learner(kw):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(512, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))
        for m in model:
            if isinstance(m, nn.Linear): fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=bs), DataLoader(TensorDataset(x[:bs], y[:bs]), bs=bs), device='cpu')
        learn = Learner(dls, model, loss_func=F.mse_loss, opt_func=SGD, lr=1e-3,
                        cbs=[NoValid(), HeldGrads(), GradientAccumulation(n_step=n_step)])
        learn.fsdp_options = FSDPOptions(**kw)   # (sharded by hand: the Learner's FSDP2 options set directly)
        return learn
    learns = {k: learner(kw) for k,kw in MODES.items()}
    times = {k: [] for k in MODES}
    counts = {}
    for r in range(repeats+1):   # round 0 warms up
        for k in (list(MODES)[r % 3:] + list(MODES)[:r % 3]):
            learn = learns[k]
            with count_collectives() as c, learn.no_bar(), learn.no_logging():
                torch.distributed.barrier(); t = time.perf_counter()
                learn.fit(1)
                torch.distributed.barrier(); dt = time.perf_counter()-t
            s = learn.gradient_accumulation.steps
            if r: times[k].append(dt/s)
            counts[k] = dict(rs=c.reduce_scatter/s, ag=c.all_gather/s, groups=fsdp_group_count(learn.model), peak=learn.held_grads.peak)
    full = sum(p.numel()*p.element_size() for p in learns['sync every micro-batch'].model.parameters())   # DTensor: whole size
    return dict(times=times, counts=counts, full_bytes=full, params=sum(p.numel() for p in learns['+ gathered_params'].model.parameters()))

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--n-step', type=int, default=4)
    p.add_argument('--bs', type=int, default=16)
    p.add_argument('--steps', type=int, default=6)
    p.add_argument('--hidden', type=int, default=1024)
    p.add_argument('--repeats', type=int, default=5)
    p.add_argument('--world', type=int, default=2)
    a = p.parse_args(argv)
    res = launch_gloo(run, world=a.world, args=(a.n_step, a.bs, a.steps, a.hidden, a.repeats))
    if res is None: sys.exit('a rank failed')
    base = res['times']['sync every micro-batch']
    print(machine())
    print(f"FSDP2 over {a.world} gloo ranks, MLP 512-{a.hidden}-{a.hidden}-10 float32 ({res['params']/1e6:.2f}M parameters, "
          f"{res['full_bytes']/2**20:.1f} MiB of gradient unsharded), micro-batch {a.bs} x n_step {a.n_step}, {a.repeats} rounds\n")
    print('| mode | reduce-scatters / step | all-gathers / step | time / step (ms) | time vs sync every micro-batch | held gradient peak per rank (MiB) |')
    print('|---|---|---|---|---|---|')
    for k in MODES:
        c,t = res['counts'][k],res['times'][k]
        m,lo,hi = mean_ci([x/b for x,b in zip(t, base)])
        print(f"| {k} | {c['rs']:.0f} ({c['rs']/c['groups']:.0f} round{'s' if c['rs'] != c['groups'] else ''} of {c['groups']} groups) | "
              f"{c['ag']:.0f} | {1000*sorted(t)[len(t)//2]:.1f} | {m:.3f} ({lo:.3f}-{hi:.3f}) | {c['peak']/2**20:.2f} |")

if __name__ == '__main__': main()
