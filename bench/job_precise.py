"""What the job's default BatchNorm setting costs (issue 38): `--bn auto` ('pool' with the statistics recomputed from
512 training items) at every epoch's end (0.2.0, until this round), at the last epoch's end only (today's default),
and 'pool' without any recomputation, side by side in one run: the job's defaults (digits transfer task,
resnet_tiny pretrained, loader batch 4 x 8 = 32 a step, one-cycle 3e-3, 3 epochs), the same seeds, settings alternating
within each round (rotating which goes first). Printed per setting: the training time (the fit, `finetune`'s
`train_seconds`), the final accuracy per seed, and the recomputation's cost as a fraction of training without it.

    python bench/job_precise.py --seeds 3 --rounds 3
"""
import argparse, statistics, time, warnings

SETTINGS = {'every epoch (0.2.0)': dict(bn_precise=512, precise_at='epoch'),
            'last epoch (default)': dict(bn_precise=512, precise_at='end'),
            'none': dict(bn_precise=None, precise_at='end')}

def run(setting, seed, epochs):
    import torch
    from accum_finetune.data import digits_dls
    from accum_finetune.finetune import build_learner, finetune
    from accum_finetune.models import DEFAULT_ARCH
    from accum_finetune.pretrain import pretrained_checkpoint
    dls = digits_dls(4, seed=seed)
    learn = build_learner(dls, DEFAULT_ARCH, weights=str(pretrained_checkpoint()), n_step=8, bn='pool', seed=seed, **SETTINGS[setting])
    m = finetune(learn, epochs, 3e-3, progress=False)
    return learn.throughput.secs,m['accuracy']   # (the training loops' time, unrounded)

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--seeds', type=int, default=3)
    p.add_argument('--rounds', type=int, default=2, help='runs of every (setting, seed), alternating')
    p.add_argument('--epochs', type=int, default=3)
    p.add_argument('--threads', type=int, default=None)
    a = p.parse_args(argv)
    warnings.filterwarnings('ignore')
    import torch
    if a.threads: torch.set_num_threads(a.threads)
    from common import machine
    names = list(SETTINGS)
    secs,accs = {k: [] for k in names},{k: {} for k in names}
    run(names[0], 0, 1)   # warm-up: imports, allocator, the pretrained checkpoint
    for r in range(a.rounds):
        for seed in range(a.seeds):
            order = names[(r+seed) % len(names):] + names[:(r+seed) % len(names)]
            for k in order:
                t,acc = run(k, seed, a.epochs)
                secs[k].append(t); accs[k][seed] = acc
    print(f"{machine()} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    print(f"`python bench/job_precise.py --seeds {a.seeds} --rounds {a.rounds}`: the job's defaults, {a.epochs} epochs, "
          f"medians of {a.rounds*a.seeds} runs each\n")
    none = statistics.median(secs['none'])
    print("| BatchNorm statistics | training s (median) | recomputation's cost (of training without) | accuracy per seed | mean |")
    print("|---|---:|---:|---|---:|")
    for k in names:
        t = statistics.median(secs[k])
        acc = [accs[k][s] for s in range(a.seeds)]
        print(f"| {k} | {t:.2f} | {'-' if k == 'none' else f'{t/none-1:+.1%}'} | {', '.join(f'{x:.4f}' for x in acc)} | {statistics.mean(acc):.4f} |")
    old,new = statistics.median(secs[names[0]]),statistics.median(secs[names[1]])
    print(f"\ntoday's default / 0.2.0's: {new/old:.3f} of the training time ({old/new:.2f}x faster)")

if __name__ == '__main__': main()
