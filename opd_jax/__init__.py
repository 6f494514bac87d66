"""opd_jax: GLM-5.2-style RL post-training of language models in JAX."""

__version__ = "0.1.0"
