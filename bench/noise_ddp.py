"""Time to accuracy under DDP (issue 40): the window grown with the noise scale against fixed windows, side by side in
one run, on 2 gloo processes (CPU). notebook 04's transfer task (bench/noise_study.py's `transfer`): each rank reads its
half of the training set (fastai's `DistributedDL`) in micro-batches of 2, so a window of 2 micro-batches a rank is the
study's base window of 8 items; SGD with momentum 0.9, learning rate 1e-2, /4 at 1/3 and 2/3 of training, 8 epochs.

- `fixed`: 8 items a step, constant learning rate; `fixed+decay`: with the decay;
- `grown`: `noise.schedule(lo=4)` at its defaults (half of B_simple, at most 8 x `lo`, the learning rate scaled
  linearly with the window; per rank, so from 8 items over both), with the decay.

Printed: per variant, the final accuracy, optimizer steps, gradient all-reduces a epoch (DDP's rounds, counted by a
communication hook), fit wall time, and the wall time at which the validation accuracy (after each epoch) first reaches
the fixed window's final accuracy, medians over `--seeds`, ratios against `fixed`.

    python bench/noise_ddp.py --seeds 3
"""
import argparse, statistics, sys, time, warnings
import torch
import torch.distributed as dist

from common import launch_gloo, machine

MICRO_BS, LR, EPOCHS = 2, 1e-2, 8
VARIANTS = ('fixed', 'fixed+decay', 'grown')

def run(rank, world, variant, seed, epochs):
    warnings.filterwarnings('ignore')
    from functools import partial
    from torch.nn.parallel import DistributedDataParallel as DDP
    from fastai.vision.all import Learner, accuracy, CrossEntropyLossFlat, SGD, set_seed, Callback, ParamScheduler, SchedNo, combine_scheds
    from fastai.distributed import DistributedDL
    from accum_callback import GradientAccumulation, BatchNormAccumulation, GradientNoiseScale
    from accum_callback.core.distributed import count_allreduces
    from accum_finetune.data import digits_dls
    from accum_finetune.models import DEFAULT_ARCH, create_model, load_weights
    from accum_finetune.pretrain import pretrained_checkpoint
    set_seed(seed, reproducible=True)
    dls = digits_dls(MICRO_BS, seed=seed)
    dls.train = DistributedDL(dls.train, rank, world)
    model = create_model(DEFAULT_ARCH, dls.c); load_weights(model, str(pretrained_checkpoint()), DEFAULT_ARCH)
    noise = GradientNoiseScale()
    ga = GradientAccumulation(target_bs=noise.schedule(lo=2*MICRO_BS) if variant == 'grown' else 2*MICRO_BS)

    class Clock(Callback):
        "Validation accuracy and wall time after each epoch"
        order = 100
        def before_fit(self): self.t0,self.log = time.perf_counter(),[]
        def after_epoch(self): self.log.append((time.perf_counter()-self.t0, float(self.recorder.metrics[0].value)))
    clock = Clock()
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), metrics=accuracy, opt_func=partial(SGD, mom=0.9),
                    cbs=[ga, BatchNormAccumulation('pool'), noise, clock])
    learn.model = DDP(learn.model)
    counter = count_allreduces(learn.model)
    sched = [ParamScheduler({'lr': combine_scheds([1/3, 1/3, 1/3], [SchedNo(LR, LR), SchedNo(LR/4, LR/4), SchedNo(LR/16, LR/16)])})]
    dist.barrier()
    with learn.no_bar(), learn.no_logging(): learn.fit(epochs, LR, cbs=sched if variant != 'fixed' else [])
    return dict(variant=variant, seed=seed, log=clock.log, steps=ga.steps, rounds=counter.n_rounds,
                accuracy=clock.log[-1][1], wall=clock.log[-1][0])

def _runs(rank, world, args):
    from accum_callback.core.distributed import gloo_distributed_dl
    with gloo_distributed_dl(): return _all(rank, world, args)

def _all(rank, world, args):
    out = []
    for seed in range(args.seeds):
        for v in VARIANTS: out.append(run(rank, world, v, seed, args.epochs))   # alternating: the machine's drift shared
    return out

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--seeds', type=int, default=3)
    p.add_argument('--epochs', type=int, default=EPOCHS)
    args = p.parse_args(argv)
    res = launch_gloo(_runs, 2, (args,), threads=1, timeout=3600)
    if res is None: sys.exit('noise_ddp: a DDP process failed')
    by = {v: [r for r in res if r['variant'] == v] for v in VARIANTS}
    med = lambda xs: statistics.median(xs)
    def reach(r, target):
        return next((t for t,a in r['log'] if a >= target - 1e-9), float('inf'))
    print(f"{machine()} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    print(f"`python bench/noise_ddp.py {' '.join(sys.argv[1:])}`: 2 processes, gloo on CPU, 1 torch thread each, "
          f"{args.epochs} epochs, micro-batch {MICRO_BS} a rank, seeds {list(range(args.seeds))}, medians\n")
    print("| window | accuracy (per seed) | optimizer steps | all-reduces a epoch | fit wall (s) | time to fixed's final accuracy (s) |")
    print("|---|---|---:|---:|---:|---:|")
    base = {}
    for v in VARIANTS:
        rs = by[v]
        # the time at which each seed's run first reaches the `fixed` run's final accuracy on that seed
        ttas = [reach(r, f['accuracy']) for r,f in zip(rs, by['fixed'])]
        row = dict(wall=med([r['wall'] for r in rs]), tta=med(ttas), rounds=med([r['rounds'] for r in rs])/args.epochs)
        base.setdefault('fixed', row)
        accs = ', '.join(f"{r['accuracy']:.4f}" for r in rs)
        print(f"| {v} | {med([r['accuracy'] for r in rs]):.4f} ({accs}) | "
              f"{med([r['steps'] for r in rs]):.0f} | {row['rounds']:.0f} | {row['wall']:.1f} | {row['tta']:.1f} |")
        base[v] = row
    f,g = base['fixed'],base['grown']
    print(f"\ngrown / fixed: fit wall {g['wall']/f['wall']:.2f}, time to fixed's final accuracy {g['tta']/f['tta']:.2f}, "
          f"all-reduces {g['rounds']/f['rounds']:.2f}")

if __name__ == '__main__': main()
