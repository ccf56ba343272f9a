"""The networks of the Flax ensembling HOWTO, a cluster wiki's Flax page and the "JAX —
now and future" talk, as Flax linen modules.

Every module takes ``train`` (ignored by modules without dropout or batch norm), so the
training step can call any of them the same way.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from meshkit.models._attention import dot_product_attention as dot_product_attention
from meshkit.models._generate import greedy_generate as greedy_generate
from meshkit.models._hf_llama import llama_from_hf as llama_from_hf
from meshkit.models._hf_llama import load_hf_params as load_hf_params
from meshkit.models._hf_llama import save_hf_params as save_hf_params
from meshkit.models._remat import RematPolicy as RematPolicy
from meshkit.models._resnet import BasicBlock as BasicBlock
from meshkit.models._resnet import Bottleneck as Bottleneck
from meshkit.models._resnet import ResNet as ResNet
from meshkit.models._resnet import ResNet18 as ResNet18
from meshkit.models._resnet import ResNet34 as ResNet34
from meshkit.models._resnet import ResNet50 as ResNet50
from meshkit.models._transformer import RopeScaling as RopeScaling
from meshkit.models._transformer import Transformer as Transformer
from meshkit.models._transformer import llama as llama
from meshkit.models._transformer import llama_architecture as llama_architecture
from meshkit.models._vit import ViT as ViT
from meshkit.models._vit import ViTSmall as ViTSmall
from meshkit.models._vit import ViTTiny as ViTTiny


class MnistCNN(nn.Module):
    """The Flax ensembling HOWTO's MNIST CNN: two 3×3 convolutions, two dense layers.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> variables = MnistCNN().init(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
        >>> MnistCNN().apply(variables, jnp.zeros((2, 28, 28, 1))).shape
        (2, 10)
    """

    num_classes: int = 10

    @nn.compact
    def __call__(self, x_BxHxWxC: jax.Array, *, train: bool = False) -> jax.Array:
        del train
        x = nn.relu(nn.Conv(32, (3, 3))(x_BxHxWxC))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Conv(64, (3, 3))(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(self.num_classes)(x)


class CifarNet(nn.Module):
    """A cluster wiki's LeNet-style CIFAR-10 net: two 5×5 convolutions, pooling, three dense layers.

    As on the wiki page, convolutions pad to keep their size and pooling uses Flax's default
    stride of 1, so the first dense layer sees 30×30×16 features.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> variables = CifarNet().init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
        >>> CifarNet().apply(variables, jnp.zeros((2, 32, 32, 3))).shape
        (2, 10)
    """

    num_classes: int = 10

    @nn.compact
    def __call__(self, x_BxHxWxC: jax.Array, *, train: bool = False) -> jax.Array:
        del train
        x = nn.max_pool(nn.relu(nn.Conv(6, (5, 5))(x_BxHxWxC)), (2, 2))
        x = nn.max_pool(nn.relu(nn.Conv(16, (5, 5))(x)), (2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(120)(x))
        x = nn.relu(nn.Dense(84)(x))
        return nn.Dense(self.num_classes)(x)


class NormCNN(nn.Module):
    """A small CNN with batch norm and dropout: mutable ``batch_stats`` and a dropout RNG,
    the train state of the "JAX — now and future" talk.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> variables = NormCNN().init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))
        >>> sorted(variables)
        ['batch_stats', 'params']
    """

    num_classes: int = 10
    dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, x_BxHxWxC: jax.Array, *, train: bool = False) -> jax.Array:
        x = nn.Conv(16, (3, 3))(x_BxHxWxC)
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.Dropout(self.dropout_rate, deterministic=not train)(nn.relu(nn.Dense(64)(x)))
        return nn.Dense(self.num_classes)(x)


MODELS: dict[str, type[nn.Module]] = {
    "mnist_cnn": MnistCNN,
    "cifar_net": CifarNet,
    "norm_cnn": NormCNN,
    "resnet18": ResNet18,
    "resnet50": ResNet50,
    "vit_tiny": ViTTiny,
    "vit_small": ViTSmall,
}
"""Models by the names recipes accept."""
