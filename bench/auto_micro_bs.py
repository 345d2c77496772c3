"""`MicroBatching('auto')` on a GPU with its memory capped: the size it finds, and images/s against
every fixed micro-batch (the best hand-picked one) and against the uncapped loader batch, measured in one run.

    python bench/auto_micro_bs.py                        # resnet50, 224px, fp16, loader batch 256, 8 GiB cap
    python bench/auto_micro_bs.py --cap-gib 8 --arch resnet50 --bs 256 --batches 4

The cap is `torch.cuda.set_per_process_memory_fraction` (the uncapped batch is timed first). Each configuration trains
a fresh Learner for a warm-up epoch, then a timed epoch (training phase, synchronised), on device-resident fp16 images.
Prints a markdown table with the device, versions and the command. Needs CUDA."""
import argparse, datetime, sys, warnings
import torch, torchvision
from fastai.callback.fp16 import MixedPrecision

from accum_callback import GradientAccumulation, MicroBatching
from accum_callback.micro import is_out_of_memory
from common import CudaSync, fit_time, learner

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--arch', default='resnet50'); p.add_argument('--px', type=int, default=224)
    p.add_argument('--bs', type=int, default=256, help='loader batch (= the effective batch: one step per loader batch)')
    p.add_argument('--batches', type=int, default=4, help='loader batches per epoch')
    p.add_argument('--cap-gib', type=float, default=8.)
    p.add_argument('--device', default='cuda', help='cuda; cpu only smoke-tests the code path (no cap, fp32: the figures mean nothing)')
    args = p.parse_args(argv)
    dev = torch.device(args.device); cuda = dev.type == 'cuda'
    if cuda and not torch.cuda.is_available(): sys.exit('auto_micro_bs: needs a CUDA device (or --device cpu for a smoke test)')
    g = torch.Generator(device=dev).manual_seed(0)
    n = args.bs*args.batches
    ds = torch.utils.data.TensorDataset(torch.randn(n, 3, args.px, args.px, device=dev, generator=g,
                                                    dtype=torch.float16 if cuda else torch.float32),
                                        torch.randint(0, 10, (n,), device=dev, generator=g))
    def fit(cbs):
        "images/s of the timed epoch after a warm-up epoch, and the GradientAccumulation callback (or the error)"
        torch.manual_seed(0)
        learn = learner(torchvision.models.get_model(args.arch, num_classes=10).to(dev), ds, args.bs,
                        cbs + ([MixedPrecision()] if cuda else []), device=dev, prebatched=True)
        if cuda: learn.add_cb(CudaSync())
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter('always')
                fit_time(learn); t = fit_time(learn)
            return n/t, getattr(learn, 'micro_batching', None), [str(w.message) for w in caught if 'GradientAccumulation' in str(w.message)]
        except Exception as e:
            if not is_out_of_memory(e): raise
            return None, None, [f'{type(e).__name__}']
        finally:
            del learn
            if cuda: torch.cuda.empty_cache()
    rows = []
    big,_,_ = fit([])                       # the uncapped loader batch, no accumulation
    if cuda:
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.empty_cache(); torch.cuda.set_per_process_memory_fraction(min(1., args.cap_gib*2**30/total), torch.cuda.current_device())
    fixed = {}
    m = args.bs
    while m >= max(8, args.bs//32):
        fixed[m],_,_ = fit([GradientAccumulation(n_step=1), MicroBatching(m)]); m //= 2
    auto,mb,msgs = fit([GradientAccumulation(n_step=1), MicroBatching('auto')])
    ok = {k: v for k,v in fixed.items() if v}
    best = max(ok, key=ok.get) if ok else None
    label = f'{args.arch} {args.px}px fp16, loader batch {args.bs}, {args.cap_gib:g} GiB cap'
    rows.append(['fixed micro_bs under the cap (images/s)', ', '.join(f'{k}: {v:.0f}' if v else f'{k}: OOM' for k,v in fixed.items()), 'info', '—'])
    if auto is None: rows.append(["micro_bs='auto'", 'an out-of-memory error escaped', 'none', 'no'])
    else:
        rows.append(["micro_bs='auto': size found (trials, images/s)", f"{mb.size} ({', '.join(f'{k}: {v:.0f}' for k,v in mb.trials.items())})", 'info', '—'])
        r = auto/ok[best] if best else float('nan')
        rows.append([f"micro_bs='auto' / best fixed micro_bs ({best})", f'{r:.3f} ({auto:.0f} / {ok[best]:.0f} images/s)', '>= 0.95', 'yes' if r >= 0.95 else 'no'])
        if big: rows.append([f"micro_bs='auto' under the cap / batch {args.bs} uncapped", f'{auto/big:.3f} ({auto:.0f} / {big:.0f} images/s)', 'info', '—'])
    print(f'## micro_bs=\'auto\' ({datetime.datetime.now():%Y-%m-%d %H:%M}): {label}\n')
    print('| measure | value | goal | met? |\n|---|---|---|---|')
    for r in rows: print('| ' + ' | '.join(str(c) for c in r) + ' |')
    print(f"\n- device: {torch.cuda.get_device_name(dev) if cuda else 'cpu (smoke test)'}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"- command: `python bench/auto_micro_bs.py {' '.join(sys.argv[1:] if argv is None else argv)}`")
    print('- messages: ' + ' / '.join(dict.fromkeys(msgs)))

if __name__ == '__main__': main()
