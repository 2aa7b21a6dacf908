"""The install is pinned whole: every package that requirements.txt's packages, torch, and
(where it is installed) scripts/bench.sh's matplotlib pull in, at any depth, is pinned (in
constraints.txt, or in requirements.txt for its own) at the version installed here. A bump
that brings a new dependency fails here until that dependency is pinned too, instead of a
fresh machine installing whatever release is newest on the day (scripts/setup_env.sh)."""
import importlib.metadata as md
import os
import re

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _name(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(filename):
    """{normalized name: version} of the ``name==version`` lines of a requirements file."""
    pins = {}
    with open(os.path.join(ROOT, filename)) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                req = Requirement(line)
                (spec,) = req.specifier  # one exact pin per line
                assert spec.operator == "==", line
                pins[_name(req.name)] = spec.version
    return pins


def _installed(name):
    try:
        md.version(name)
    except md.PackageNotFoundError:
        return False
    return True


def _dependencies(name):
    """The requirements of an installed distribution that apply here (markers evaluated,
    no extras asked for)."""
    env = dict(default_environment(), extra="")
    for text in md.requires(name) or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(env):
            yield _name(req.name)


def test_every_package_the_install_pulls_in_is_pinned_at_its_installed_version():
    required = _pins("requirements.txt")
    pins = {**_pins("constraints.txt"), **required}
    roots = set(required) | {"torch"}
    if _installed("matplotlib"):  # scripts/bench.sh's, where it has run
        roots.add("matplotlib")
    seen, todo = set(), sorted(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(_dependencies(name))
    assert len(seen) > len(roots)  # the walk went below the roots
    unpinned = sorted(n for n in seen if n not in pins)
    assert not unpinned, f"installed as dependencies but not pinned in constraints.txt: {unpinned}"
    for name in sorted(seen):
        installed = md.version(name).split("+")[0]  # torch's local version: 2.13.0+cpu
        assert installed == pins[name], f"{name}: installed {installed}, pinned {pins[name]}"
