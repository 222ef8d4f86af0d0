"""bpd: blockwise parallel decoding for deep autoregressive models, in JAX/Flax."""

import setuptools

setuptools.setup(
    name="bpd",
    version="0.1.0",
    description="Blockwise parallel decoding (Stern, Shazeer, Uszkoreit 2018) in JAX/Flax.",
    packages=setuptools.find_packages(include=["bpd", "bpd.*", "configs", "experiments"]),
    # The skinny-matmul kernel's C++ sources: built on first use with the system's compiler (bpd/kernels/build.py).
    package_data={"bpd.kernels": ["*.cc", "*.h"]},
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.6.0",  # jax.sharding.AxisType
        "flax>=0.10.0",
        "optax>=0.2.2",
        "orbax-checkpoint>=0.5.20",
        "ml-collections>=0.1.1",
        "absl-py>=1.4",
        "sacrebleu>=2.3",
        "sentencepiece>=0.1.99",
        "tensorflow-datasets>=4.9.4",
        "importlib_resources>=5.0",  # tfds needs it at import time without TensorFlow
        "numpy>=1.24",
        "matplotlib>=3.7",
        "tensorboardX>=2.6",
    ],
    extras_require={
        "test": ["pytest>=7", "pytest-xdist>=3", "hypothesis>=6.80", "chex>=0.1.86"],
        # bench_decode --tpu and bench_scale --mode=preflight: the TPU compiler (libtpu, ~700 MB, the version matching
        # jax) to compile for a TPU topology and read XLA's cost and memory analyses without a TPU. Optional: nothing
        # else needs it.
        "tpu": ["jax[tpu]"],
    },
)
