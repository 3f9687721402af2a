import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from ddpguide.core.data import (
    UnpaddedDistributedSampler,
    load_dataset,
    load_digits,
    load_mnist,
    mnist_available,
    rank_generator,
    train_loader,
)


def test_digits_are_real_images_resized_for_the_convnet():
    data = load_digits()
    images, labels = data.train.tensors
    assert images.shape[1:] == (1, 28, 28)
    assert 0.0 <= images.min() and images.max() <= 1.0
    assert len(data.train) + len(data.test) == 1797
    assert set(labels.tolist()) == set(range(10))


def test_auto_uses_digits_when_mnist_is_absent(tmp_path):
    assert not mnist_available(tmp_path)
    assert load_dataset("auto", root=tmp_path).name == "digits"
    with pytest.raises(FileNotFoundError, match="MNIST files not found"):
        load_mnist(tmp_path)
    with pytest.raises(ValueError, match="unknown dataset 'cifar'"):
        load_dataset("cifar")


def _shards(size, world_size, epoch, drop_last=False):
    dataset = TensorDataset(torch.arange(size))
    out = []
    for rank in range(world_size):
        sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=1, drop_last=drop_last)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


@pytest.mark.parametrize("size, world_size", [(12, 2), (12, 3), (10, 4)])
def test_distributed_sampler_shards_cover_the_dataset(size, world_size):
    shards = _shards(size, world_size, epoch=0)
    assert len({len(s) for s in shards}) == 1  # equal length: the last round is padded
    union = [i for s in shards for i in s]
    assert set(union) == set(range(size))
    padding = len(union) - size
    assert padding == (-size) % world_size
    if padding == 0:
        for a in range(world_size):
            for b in range(a + 1, world_size):
                assert not set(shards[a]) & set(shards[b])


def test_order_changes_with_set_epoch_and_only_with_it():
    assert _shards(40, 2, epoch=0) == _shards(40, 2, epoch=0)
    assert _shards(40, 2, epoch=0) != _shards(40, 2, epoch=1)


@pytest.mark.parametrize("size, world_size", [(10, 1), (10, 3), (7, 4), (2, 3)])
def test_unpadded_sampler_counts_every_sample_once(size, world_size):
    shards = [list(UnpaddedDistributedSampler(size, world_size, r)) for r in range(world_size)]
    assert sorted(i for s in shards for i in s) == list(range(size))
    assert [len(UnpaddedDistributedSampler(size, world_size, r)) for r in range(world_size)] == [len(s) for s in shards]


def test_rank_generators_differ_and_repeat():
    a = torch.rand(3, generator=rank_generator(0))
    assert torch.equal(a, torch.rand(3, generator=rank_generator(0)))
    assert not torch.equal(a, torch.rand(3, generator=rank_generator(1)))


def test_train_loader_validates_batch_size():
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        train_loader(TensorDataset(torch.arange(4)), 0)
