"""The job's input pipeline on a folder of JPEGs: fastai's pipeline as the job ran it before 0.2.0 (PIL decode and
`Resize` of every image in every epoch) against the decode cache (each image decoded once; batches read whole from a
memory-mapped uint8 array, augmented and normalised on the device), side by side in one run.

    python bench/loader_bench.py                     # 2000 generated JPEGs of 256-500 px, 224 px, CPU
    python bench/loader_bench.py --data DIR --size 224 --images 2000 --job

- loader alone (no model): images/s over one epoch of training batches at `--size`, moved to the device with their
  batch transforms; fastai's pipeline with the job's workers on this machine (none on a CPU, as the job does; or
  `--workers`), the cache without and with fastai's `aug_transforms` (on the device). Goal (issue 29): the cache at
  least 10x fastai's pipeline and 3000 images/s on 2 CPU cores.
- `--job`: the whole job (`resnet_tiny`, micro-batch 4 x 8, `--job-size` px, 2 epochs) through each pipeline: the
  seconds of the second epoch's training.
- on a GPU also: the job's images/s against the same model on batches already on the GPU (same micro-batch and
  precision): goal >= 0.75 (the GPU does not wait for the loader)."""
import argparse, os, shutil, tempfile, time, warnings
from pathlib import Path
import numpy as np, torch
from common import machine

def make_jpegs(root:Path, n:int, n_cls:int=10, lo:int=256, hi:int=500, seed:int=0)->Path:
    "`n` JPEGs of random sizes in `lo..hi` px, `n_cls` class folders: smooth colour fields with noise (compressible)"
    from PIL import Image
    r = np.random.default_rng(seed)
    for i in range(n):
        c = i % n_cls; (root/f'c{c}').mkdir(parents=True, exist_ok=True)
        w,h = r.integers(lo, hi+1, 2)
        yy,xx = np.mgrid[0:h, 0:w]
        base = np.stack([(xx*(c+1) % 255), (yy*(c+2) % 255), ((xx+yy)*3 % 255)], -1).astype(np.float32)
        img = np.clip(base + r.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(root/f'c{c}'/f'{i}.jpg', quality=85)
    return root

def images_per_s(dl, max_batches=None)->tuple[float,int]:
    n,t = 0,time.perf_counter()
    for i,(x,y) in enumerate(dl):
        n += len(y)
        if max_batches and i+1 >= max_batches: break
    if x.is_cuda: torch.cuda.synchronize()
    return n/(time.perf_counter()-t),n

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--data', type=Path, default=None, help='a folder of images (default: generated JPEGs)')
    p.add_argument('--images', type=int, default=2000)
    p.add_argument('--size', type=int, default=224)
    p.add_argument('--bs', type=int, default=32)
    p.add_argument('--workers', type=int, default=None, help="fastai pipeline's workers (default: the job's: 0 on a CPU, min(8, cores) on a GPU)")
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--job', action='store_true', help='also time the whole job, epoch 2')
    p.add_argument('--job-size', type=int, default=64)
    a = p.parse_args(argv)
    warnings.filterwarnings('ignore')
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix='loader-bench-'))
    try:
        t = time.perf_counter()
        data = a.data or make_jpegs(tmp/'jpegs', a.images)
        made = time.perf_counter()-t
        from accum_finetune.data import folder_dls
        cuda = a.device.startswith('cuda')
        workers = a.workers if a.workers is not None else (min(8, os.cpu_count() or 1) if cuda else 0)
        # fastai's pipeline as the job ran it (the workers set here)
        import accum_finetune.data as D
        dls_old = folder_dls(data, a.bs, a.size, 0.2, 0, device=a.device, cache=None, augment=False)
        dls_old.train.fake_l.num_workers = workers
        old,n_old = images_per_s(dls_old.train)
        # the cache: built once (timed), then read
        t = time.perf_counter()
        dls_new = folder_dls(data, a.bs, a.size, 0.2, 0, device=a.device, cache=tmp/'cache', augment=False)
        built = time.perf_counter()-t
        images_per_s(dls_new.train, 2)   # warm (the page cache)
        new,n_new = images_per_s(dls_new.train)
        dls_aug = folder_dls(data, a.bs, a.size, 0.2, 0, device=a.device, cache=tmp/'cache', augment=True)
        images_per_s(dls_aug.train, 2)
        aug,_ = images_per_s(dls_aug.train)
        print(machine())
        print(f"{n_old} training images ({'generated in %.0f s, ' % made if a.data is None else ''}{data}), {a.size} px, batch "
              f"{a.bs}, {a.device}, {os.cpu_count()} cores; fastai's pipeline with {workers} worker(s)")
        print(f"loader alone, images/s: fastai's pipeline {old:.0f}; the cache {new:.0f} ({new/old:.1f}x), with "
              f"aug_transforms on the {a.device} {aug:.0f} ({aug/old:.1f}x); goal >= 10x and >= 3000 images/s")
        print(f"the cache built in {built:.1f} s (every image decoded and resized once: {len(dls_new.train.dataset) + len(dls_new.valid.dataset)} images)")
        if a.job: job_epochs(data, tmp, a)
        if cuda: report_gpu(data, tmp/'cache', a)
    finally: shutil.rmtree(tmp, ignore_errors=True)

def job_epochs(data, tmp, a):
    "The job's second epoch (training phase) through each pipeline (resnet_tiny, micro-batch 4 x 8, --job-size px)"
    from fastai.callback.core import Callback
    from accum_finetune.data import folder_dls
    from accum_finetune.finetune import build_learner
    class EpochTimes(Callback):
        order = 100
        def before_fit(self): self.t = []
        def before_train(self): self.t0 = time.perf_counter()
        def after_train(self): self.t.append(time.perf_counter() - self.t0)
    secs = {}
    for name,cache in (('fastai', None), ('cache', tmp/'cache')):
        dls = folder_dls(data, 4, a.job_size, 0.2, 0, device=a.device, cache=cache, augment=False)
        learn = build_learner(dls, 'resnet_tiny', n_step=8, bn='pool', cbs=[EpochTimes()])
        with learn.no_bar(), learn.no_logging(): learn.fit(2)
        secs[name] = learn.epoch_times.t[1]
    print(f"the job (resnet_tiny, 4 x 8, {a.job_size} px, {len(dls.train.dataset)} images) training time of epoch 2: "
          f"fastai's pipeline {secs['fastai']:.1f} s, the cache {secs['cache']:.1f} s ({secs['fastai']/secs['cache']:.2f}x faster)")

def gpu_bound(data, cache, device, arch='resnet50', size=224, mb=32, k=8, precision='bf16', windows=4)->dict:
    """The job's training images/s from the cache (augmented on the device) against the same model, micro-batch and
    precision on batches already on the device (the model's own speed): their ratio, goal >= 0.75 on a GPU"""
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from accum_finetune.data import folder_dls
    from accum_finetune.finetune import build_learner
    dls = folder_dls(data, mb, size, 0.2, 0, device=device, cache=cache, augment=True)
    n = min(len(dls.train), k*windows)   # (a whole number of windows)
    learn = build_learner(dls, arch, n_step=k, bn='pool', precision=precision)
    def rate(l, limit):
        from fastai.callback.training import ShortEpochCallback
        with l.no_bar(), l.no_logging(): l.fit(1, cbs=ShortEpochCallback(pct=limit/len(l.dls.train), short_valid=True))
        return l.throughput.images_per_s
    rate(learn, n)   # warm-up: cuDNN picks its algorithms, the page cache fills
    job = rate(learn, n)
    x,y = dls.train.one_batch()
    batches = [(x.detach().clone(), y.clone()) for _ in range(n)]   # the same shapes, resident on the device
    resident = DataLoaders(DataLoader(batches, bs=None, shuffle=False), DataLoader(batches[:1], bs=None), device=device)
    resident.c = dls.c
    ref = build_learner(resident, arch, n_step=k, bn='pool', precision=precision)
    rate(ref, n)
    model = rate(ref, n)
    return dict(job=job, model=model, ratio=job/model)

def report_gpu(data, cache, a):
    r = gpu_bound(data, cache, a.device)
    import torch
    print(f"{torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda}): resnet50 224 px, "
          f"micro-batch 32 x 8, bf16: the job from the cache {r['job']:.0f} images/s, the model on device-resident "
          f"batches {r['model']:.0f}: ratio {r['ratio']:.2f} (goal >= 0.75)")

if __name__ == '__main__': main()
