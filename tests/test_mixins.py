"""Classes made at run time (pnmix_patch.mixins): made once, undone, pickled, set all or none."""

import pickle
import threading

import pytest
import torch

from pnmix_patch.mixins import RuntimeMixin, mixed_class, set_classes, unmixed_class


class Doubling(RuntimeMixin):
    prefix = "Doubled"

    def forward(self, x):
        return 2 * super().forward(x)


def test_a_mixed_class_is_made_once_and_undone():
    cls = mixed_class(Doubling, torch.nn.Linear)
    assert cls is mixed_class(Doubling, torch.nn.Linear) and cls.__name__ == "DoubledLinear"
    assert unmixed_class(cls, Doubling) is torch.nn.Linear
    assert unmixed_class(cls, RuntimeMixin) is None and unmixed_class(torch.nn.Linear, Doubling) is None
    layer = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    want = 2 * layer(x)
    set_classes([(layer, cls)])
    torch.testing.assert_close(layer(x), want)
    torch.testing.assert_close(pickle.loads(pickle.dumps(layer))(x), want)


class Halving(RuntimeMixin):
    prefix = "Halved"

    def forward(self, x):
        return super().forward(x) / 2


def test_a_class_mixed_over_a_mixed_class_pickles():
    layer = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    want = layer(x)
    set_classes([(layer, mixed_class(Halving, mixed_class(Doubling, torch.nn.Linear)))])
    assert type(layer).__name__ == "HalvedDoubledLinear"
    loaded = pickle.loads(pickle.dumps(layer))
    assert type(loaded) is type(layer)
    torch.testing.assert_close(loaded(x), want)


def test_threads_mixing_one_pair_get_one_class():
    class Fresh(RuntimeMixin):
        prefix = "Fresh"

    made, start = [], threading.Barrier(8)

    def make():
        start.wait()
        made.append(mixed_class(Fresh, torch.nn.Linear))

    threads = [threading.Thread(target=make) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 8 and len(set(made)) == 1


def test_set_classes_refuses_an_instance_forward_before_changing_anything():
    first, second = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    second.forward = lambda x: x
    cls = mixed_class(Doubling, torch.nn.Linear)
    with pytest.raises(ValueError, match="Linear module has a forward set on the instance .*<lambda>"):
        set_classes([(first, cls), (second, cls)])
    assert type(first) is torch.nn.Linear and type(second) is torch.nn.Linear
