"""Classes made at run time (pnmix_patch.mixins): made once, undone, pickled, set all or none."""

import pickle

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


def test_set_classes_refuses_an_instance_forward_before_changing_anything():
    first, second = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    second.forward = lambda x: x
    cls = mixed_class(Doubling, torch.nn.Linear)
    with pytest.raises(ValueError, match="Linear module has a forward set on the instance"):
        set_classes([(first, cls), (second, cls)])
    assert type(first) is torch.nn.Linear and type(second) is torch.nn.Linear
