"""Image preprocessing + encoding time for a 1024x768 image on the CPU (tiny projector).

Usage: python benchmarks/vision_cpu.py [DIR]  (DIR: where make-tiny writes; default a temp dir)
"""
import time, io, base64, numpy as np, torch
from PIL import Image
from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.checkpoint.vision import load_vision
from musegl_core.engine.request import ImageInput
from musegl_core.vision.preprocess import ImagePreprocessor
from musegl_cuda.executor import TorchExecutor
torch.set_num_threads(2)
import sys, tempfile
from musegl_core.tiny import make_tiny
out = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
model = str(make_tiny(out, mmproj=True)); mmproj = out + '/mmproj.gguf'
ck = load_checkpoint(model)
ex = TorchExecutor(ck, device='cpu', dtype='float32', vision=load_vision(model, mmproj, ck.config.hidden_size))
rng = np.random.default_rng(0)
y, x = np.mgrid[0:768, 0:1024]
arr = np.clip(np.stack([x % 256, y % 256, (x*y) % 256], -1) + rng.integers(-20, 21, (768, 1024, 3)), 0, 255).astype(np.uint8)
for fmt, mt in (("PNG", "image/png"), ("JPEG", "image/jpeg")):
    buf = io.BytesIO(); Image.fromarray(arr).save(buf, format=fmt); data = buf.getvalue()
    inp = ImageInput(mt, base64.b64encode(data).decode())
    prep = ImagePreprocessor(4096)
    pre, enc = [], []
    for i in range(11):
        t0 = time.perf_counter(); img = prep.preprocess(inp); t1 = time.perf_counter(); rows = ex.embed_image(img); t2 = time.perf_counter()
        pre.append(t1 - t0); enc.append(t2 - t1)
    print(fmt, len(data), 'bytes; rows', img.rows, 'grid', img.grid, 'preprocess ms median', round(1000*np.median(pre[1:]),1), 'encode ms median', round(1000*np.median(enc[1:]),1))
