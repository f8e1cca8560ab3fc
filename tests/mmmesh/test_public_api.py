"""The public face of the package: ``mmmesh.__all__`` is what it means to be,
every name resolves to the object its module defines, and importing the
package stays cheap (the CLIs import it on every start)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import mmmesh

EXPECTED = {
    "DType", "Dataplane", "DataplaneError", "Flag", "FrameReader", "Header", "MeshError",
    "Modality", "NotSupportedError", "Policy", "PolicyError", "SlaReport", "TensorSpec", "Tlv",
    "WireError", "decode_frame", "decode_header", "encode_header", "frame", "load_policy",
    "parse_modality", "parse_policy",
}


def test_all_is_the_intended_list() -> None:
    assert set(mmmesh.__all__) == EXPECTED
    assert len(mmmesh.__all__) == len(EXPECTED)


def test_every_public_name_resolves_to_its_definition() -> None:
    for name in mmmesh.__all__:
        home = importlib.import_module(mmmesh._LAZY.get(name, "mmmesh.errors"))
        assert getattr(mmmesh, name) is getattr(home, name), name
    assert issubclass(mmmesh.WireError, mmmesh.MeshError)


def test_unknown_names_are_attribute_errors() -> None:
    try:
        mmmesh.nope  # noqa: B018
    except AttributeError as e:
        assert "nope" in str(e)
    else:
        raise AssertionError("mmmesh.nope resolved")


def test_importing_the_package_loads_nothing_heavy() -> None:
    code = ("import sys, mmmesh; heavy = [m for m in ('pydantic', 'pyroute2', 'bcc', 'numpy', "
            "'yaml') if m in sys.modules]; print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "", f"import mmmesh pulled in {out}"
