"""What a kernel declares is its own: a subclass of a registered kernel takes none of its
parent's aliases unless its own body names them (else a new kernel built on an old one
would silently take over the old one's flag spellings, ``--kernel fused`` included)."""
import pytest

from mindspeed_laga.kernels import registry


@pytest.mark.parametrize("parent", [k for k in registry.KERNEL_TYPES.values() if k.aliases]
                         or pytest.skip("no registered kernel has an alias", allow_module_level=True))
def test_a_subclass_takes_no_alias_unless_it_says_so(parent):
    quiet = type("Quiet", (parent,), {"name": parent.name + "2"})
    keeps = type("Keeps", (parent,), {"name": parent.name + "3", "aliases": parent.aliases})
    assert quiet.aliases == () and keeps.aliases == parent.aliases
    assert all(registry.canonical(a) == parent.name for a in parent.aliases)


def test_an_alias_names_one_kernel():
    names = set(registry.KERNEL_TYPES)
    aliases = [a for k in registry.KERNEL_TYPES.values() for a in k.aliases]
    assert len(aliases) == len(set(aliases)) and not names & set(aliases)
