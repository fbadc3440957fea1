"""A model written for its batch size (8 rows), on its own loss, under torchrun: fit on 64 samples
with a validation set of argv[1] samples in run dir argv[2]; each process writes OK or ERR and
the message to argv[2]-RANK.txt (printed lines of two processes interleave)."""
import functools, os, sys, torch
from torch import nn
from torch.utils.data import TensorDataset
from xlatrain import Trainer, TrainConfig
BATCH, DIM, CLASSES = 8, 6, 3
class FB(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, CLASSES)
        self.register_buffer("h0", torch.zeros(BATCH, DIM))
    def forward(self, x, y):
        return {"loss": nn.functional.cross_entropy(self.fc(x.view(BATCH, -1) + self.h0), y)}
def data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())
nval = int(sys.argv[1])
torch.manual_seed(0)
t = Trainer(FB(), None, functools.partial(torch.optim.SGD, lr=0.1),
    config=TrainConfig(epochs=1, batch_size=BATCH, run_dir=sys.argv[2], tensorboard=False), backend="cpu")
out = f"{sys.argv[2]}-{os.environ['RANK']}.txt"
try:
    h = t.fit(data(64), data(nval, 1))
    with open(out, "w") as f:
        f.write(f"OK {h[-1]}")
except Exception as e:
    with open(out, "w") as f:
        f.write(f"ERR {type(e).__name__} {e}")
    raise
