"""The MNIST files the tests carry are the official ones, byte for byte."""
import hashlib

from conftest import MNIST

# As published with the MNIST database (and checked by torchvision's downloader).
OFFICIAL_MD5 = {"t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
                "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c"}


def test_the_carried_mnist_files_are_the_official_test_set():
    for name, md5 in OFFICIAL_MD5.items():
        assert hashlib.md5((MNIST / name).read_bytes()).hexdigest() == md5, f"{MNIST / name} is not the official file"
