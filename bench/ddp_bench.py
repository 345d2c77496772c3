"""Gradient all-reduces and wall time of `GradientAccumulation` under DDP, with and without `no_sync`, side by side.

Two CPU processes over gloo train the same MLP with `GradientAccumulation(n_step=n_step)`: once as shipped (micro-batches that
do not close their window run under `no_sync`), once with a DDP whose `no_sync` does nothing (every micro-batch
all-reduces, as without our callback). Runs alternate, `--repeats` of each; the table gives medians and the ratios.

    python bench/ddp_bench.py                      # defaults: n_step 8, 8 optimizer steps, ~5.3M parameters
    python bench/ddp_bench.py --n-step 4 --hidden 1024 --repeats 5
"""
import argparse, contextlib, statistics, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset
from fastai.callback.core import Callback, CancelValidException
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.learner import Learner
from fastai.optimizer import SGD

from accum_callback import GradientAccumulation
from accum_callback.core.distributed import count_allreduces
from common import launch_gloo, machine

class SyncEveryDDP(DDP):
    "DDP whose `no_sync` does nothing: every micro-batch all-reduces its gradients"
    def no_sync(self): return contextlib.nullcontext()

class NoValid(Callback):
    def before_validate(self): raise CancelValidException()

def run(rank, world, n_step, bs, steps, hidden, variant, seed=0):
    g = torch.Generator().manual_seed(seed+rank)
    n = n_step*steps*bs
    x,y = torch.randn(n, 512, generator=g),torch.randn(n, 10, generator=g)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=bs), DataLoader(TensorDataset(x[:bs], y[:bs]), bs=bs), device='cpu')
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    learn = Learner(dls, model, loss_func=F.mse_loss, opt_func=SGD, lr=1e-3, cbs=[NoValid(), GradientAccumulation(n_step=n_step)])
    learn.model = (DDP if variant == 'no_sync' else SyncEveryDDP)(model)
    counter = count_allreduces(learn.model)
    dist.barrier()
    t = time.perf_counter()
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    wall = torch.tensor([time.perf_counter()-t])
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)   # the slower rank's time is the run's time
    return dict(rounds=counter.n_rounds, calls=counter.n_calls, steps=learn.gradient_accumulation.steps,
                micro=len(dls.train), wall=wall.item(), params=sum(p.numel() for p in model.parameters()))

def _runs(rank, world, args):
    res = {'no_sync': [], 'sync_every': []}
    run(rank, world, args.n_step, args.bs, 1, args.hidden, 'no_sync')   # warm-up: first DDP run, allocator, gloo pairs
    for _ in range(args.repeats):
        for v in res: res[v].append(run(rank, world, args.n_step, args.bs, args.steps, args.hidden, v))
    return res

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--n-step', type=int, default=8, help='micro-batches per optimizer step')
    p.add_argument('--bs', type=int, default=16, help='micro-batch size per rank')
    p.add_argument('--steps', type=int, default=8, help='optimizer steps per run')
    p.add_argument('--hidden', type=int, default=2048, help='MLP width (512 -> hidden -> hidden -> 10)')
    p.add_argument('--repeats', type=int, default=3, help='runs of each variant, alternating')
    p.add_argument('--threads', type=int, default=1, help='torch threads per process')
    args = p.parse_args(argv)
    res = launch_gloo(_runs, 2, (args,), threads=args.threads)
    if res is None: sys.exit('ddp_bench: a DDP process failed')
    a,b = res['no_sync'],res['sync_every']
    med = lambda rs,k: statistics.median(r[k] for r in rs)
    r = a[0]
    print(f"{machine()} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    print(f"`python {' '.join(['bench/ddp_bench.py']+sys.argv[1:])}`: 2 processes, gloo on CPU, {r['params']/1e6:.2f}M "
          f"float32 parameters, n_step={args.n_step}, micro-batch {args.bs} per rank, {r['steps']} optimizer steps "
          f"({r['micro']} micro-batches) per run, median of {args.repeats} alternating runs, "
          f"{args.threads} torch thread(s) per process\n")
    print("| DDP | all-reduce rounds | bucket all-reduces | rounds per step | fit wall time (s) | s per step |")
    print("|---|---:|---:|---:|---:|---:|")
    for name,rs in (('with `no_sync` (GradientAccumulation)', a), ('without `no_sync` (syncs every micro-batch)', b)):
        print(f"| {name} | {rs[0]['rounds']} | {rs[0]['calls']} | {rs[0]['rounds']/rs[0]['steps']:g} | "
              f"{med(rs,'wall'):.2f} | {med(rs,'wall')/rs[0]['steps']:.3f} |")
    print(f"| ratio without / with | {b[0]['rounds']/a[0]['rounds']:.2f}x | {b[0]['calls']/a[0]['calls']:.2f}x | | "
          f"{med(b,'wall')/med(a,'wall'):.2f}x | |")
    print("\nA round: DDP all-reduces every bucket of one backward (its first backward uses one bucket, later ones "
          f"{max(r['calls']-1, 1)//max(r['rounds']-1, 1)}: it rebuilds its buckets after the first step).")
    print(f"wall times per run (s), with: {[round(x['wall'], 2) for x in a]}, without: {[round(x['wall'], 2) for x in b]}")

if __name__ == '__main__': main()
