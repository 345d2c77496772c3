"""What recomputing the BatchNorm statistics costs (`BatchNormAccumulation(precise=N)`) against one training epoch, side
by side in one run.

resnet18 (torchvision, from scratch) at 32 px, micro-batch 8, n_step 4, `--windows` optimizer steps an epoch: rounds
alternate one training epoch (fastai's loop, `GradientAccumulation`, `BatchNormAccumulation('pool')`, SGD) and one
`update_bn_stats` over `--items` training items in the Learner's micro-batches (what `precise=N` runs at every epoch's
end). The ratio of their times (mean and 95% interval over the rounds), and seconds per 1000 items each way, are
printed. Goal (issue 32): a recomputation over as many items as an epoch costs less than a third of the epoch (a
no-grad forward against a forward and a backward).

    python bench/precise_cost.py [--rounds 9] [--items 256] [--device cpu|cuda] [--threads 1]"""
import time, warnings
import torch, torchvision
from common import images, learner, machine, mean_ci, resnet_args

from accum_callback import BatchNormAccumulation, GradientAccumulation, update_bn_stats
from accum_callback.batchnorm.precise import training_items

def main(argv=None):
    a = resnet_args(__doc__, 9, argv, lambda p: p.add_argument('--items', type=int, default=256, help='items recomputed from (default 256)'))
    warnings.filterwarnings('ignore')
    mb,k = 8,4
    n = mb*k*a.windows
    learn = learner(torchvision.models.resnet18(num_classes=10), images(n, 32), mb,
                    cbs=[GradientAccumulation(n_step=k), BatchNormAccumulation('pool')], device=a.device)
    sync = (lambda: torch.cuda.synchronize()) if a.device.startswith('cuda') else (lambda: None)
    def recompute():
        sync(); t = time.perf_counter()
        update_bn_stats(learn.model, training_items(learn, a.items, mb)); sync()
        return time.perf_counter()-t
    def epoch():
        with learn.no_bar(), learn.no_logging(): learn.fit(1)
        return learn.train_timer.times[-1]
    epoch(); recompute()   # warm-up
    te,tr = [],[]
    for i in range(a.rounds):   # both orders, alternately
        for f,ts in ((epoch, te), (recompute, tr))[::1 if i % 2 else -1]: ts.append(f())
    m,lo,hi = mean_ci([r/e for r,e in zip(tr, te)])
    med = lambda xs: sorted(xs)[len(xs)//2]
    print(machine())
    print(f"resnet18 32px, micro-batch {mb} x n_step {k}, {a.device}, {a.threads} thread(s): training epoch of {n} items "
          f"{med(te):.2f} s ({1000*med(te)/n:.2f} s per 1000 items), recomputation over {a.items} items {med(tr):.2f} s "
          f"({1000*med(tr)/a.items:.2f} s per 1000 items) (medians)")
    print(f"recomputation / training epoch: {m:.3f} (95% interval {lo:.3f}-{hi:.3f}, {a.rounds} alternating rounds); "
          f"per item: {m*n/a.items:.3f} of a training item")

if __name__ == '__main__': main()
