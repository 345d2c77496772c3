"""Cost of `BatchNormAccumulation('pool')` over plain accumulation: resnet18 on small random images, CPU.

The two runs alternate (plain, pool, plain, pool, ...) on the same Learner setup, so drift in machine load hits both;
the script prints each pair and the median of the per-pair ratios, on process CPU time (what this process used, the
fairer clock on a shared machine) and on wall time.

    python bench/bn_cost.py --repeats 7 --size 32 --bs 8 --n-step 4 --n-items 64 --threads 1
"""
import argparse, statistics, time, warnings
import torch
from torch.utils.data import TensorDataset
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from fastai.optimizer import SGD
from torchvision.models import resnet18

from accum_callback import BatchNormAccumulation, GradientAccumulation

def make_learner(args, pool:bool)->Learner:
    g = torch.Generator().manual_seed(0)
    x,y = torch.randn(args.n_items, 3, args.size, args.size, generator=g),torch.randint(0, 10, (args.n_items,), generator=g)
    ds = TensorDataset(x, y)
    dls = DataLoaders(DataLoader(ds, bs=args.bs), DataLoader(TensorDataset(x[:args.bs], y[:args.bs]), bs=args.bs), device='cpu')
    torch.manual_seed(0)
    cbs = [GradientAccumulation(n_step=args.n_step)] + ([BatchNormAccumulation('pool')] if pool else [])
    return Learner(dls, resnet18(weights=None, num_classes=10), loss_func=CrossEntropyLossFlat(), opt_func=SGD, lr=1e-3, cbs=cbs)

def time_fit(learn:Learner)->tuple[float,float]:
    "(CPU seconds, wall seconds) of one epoch"
    with learn.no_bar(), learn.no_logging():
        c,w = time.process_time(),time.perf_counter(); learn.fit(1)
        return time.process_time()-c, time.perf_counter()-w

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--repeats', type=int, default=7)
    p.add_argument('--size', type=int, default=32, help='image side')
    p.add_argument('--bs', type=int, default=8, help='micro-batch size')
    p.add_argument('--n-step', type=int, default=4, help='micro-batches per optimizer step')
    p.add_argument('--n-items', type=int, default=64, help='training images per epoch')
    p.add_argument('--threads', type=int, default=1, help='torch intra-op threads')
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter('ignore')
    plain,pool = make_learner(args, False),make_learner(args, True)
    time_fit(plain); time_fit(pool)   # warm-up: allocator, oneDNN kernels, optimizer creation
    cpu,wall = [],[]
    print(f"resnet18, {args.size}x{args.size}, micro-batch {args.bs} x {args.n_step}, {args.n_items} images/epoch, "
          f"{args.threads} thread(s); seconds per epoch")
    print(f"{'repeat':>6} {'cpu plain':>10} {'cpu pool':>9} {'ratio':>6}  {'wall plain':>10} {'wall pool':>9} {'ratio':>6}")
    for i in range(args.repeats):
        a = time_fit(plain); b = time_fit(pool)
        cpu.append(b[0]/a[0]); wall.append(b[1]/a[1])
        print(f"{i:>6} {a[0]:10.3f} {b[0]:9.3f} {cpu[-1]:6.3f}  {a[1]:10.3f} {b[1]:9.3f} {wall[-1]:6.3f}")
    for name,r in (('cpu', cpu), ('wall', wall)):
        print(f"median pool/plain ratio ({name} time): {statistics.median(r):.3f} (min {min(r):.3f}, max {max(r):.3f})")
    parts(args)

def parts(args):
    "Lower-noise estimate from the parts: the hooks' cost per micro-batch and the pooled update per step, against fwd+bwd"
    from torch.nn.modules.batchnorm import _BatchNorm
    m,x = resnet18(weights=None, num_classes=10).train(),torch.randn(args.bs, 3, args.size, args.size)
    bns,cb = [l for l in m.modules() if isinstance(l, _BatchNorm)],BatchNormAccumulation('pool')
    def cpu(f, n):
        c = time.process_time()
        for _ in range(n): f()
        return (time.process_time()-c)/n
    def fb(): m(x).sum().backward()
    fb(); plain,hooked = [],[]
    for _ in range(5):
        plain.append(cpu(fb, 5)); cb._start_pool(bns); hooked.append(cpu(fb, 5)); cb._pend.clear(); cb._restore()
    cb._start_pool(bns)
    for _ in range(args.n_step): m(x); cb._win.extend(cb._pend); cb._pend.clear()
    win = list(cb._win)
    def apply(): cb._win[:] = win; cb._apply()
    step = cpu(apply, 20); cb._restore()
    p,h = statistics.median(plain),statistics.median(hooked)
    print(f"parts: fwd+bwd {p*1e3:.1f} ms plain, {h*1e3:.1f} ms hooked; pooled update {step*1e3:.2f} ms per step "
          f"({len(bns)} BatchNorm layers); estimated ratio {(h + step/args.n_step)/p:.3f}")

if __name__ == '__main__': main()
