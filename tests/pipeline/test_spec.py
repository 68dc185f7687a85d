"""Feature specs: built-ins, spec files, and every way a spec can be wrong."""

import re

import pytest
from hybridrec.common.errors import ConfigError, UserError
from hybridrec.pipeline.spec import builtin_specs, load_spec

CUSTOM = """
name = "clicks"
delimiter = ","
header = true
columns = ["clicked", "price", "user", "tags"]
label = "clicked"
dense = ["price"]
dense_type = "float64"
dense_transform = "identity"

[[categorical]]
name = "user"

[[categorical]]
name = "tags"
table = "tag"
multi_valued = true
separator = "|"
"""


def test_builtin_specs():
    assert {"criteo", "avazu"} <= set(builtin_specs())
    criteo = load_spec("criteo")
    assert criteo.columns[0] == "label" and len(criteo.columns) == 40
    assert criteo.dense == tuple(f"I{i}" for i in range(1, 14))
    assert [c.name for c in criteo.categorical] == [f"C{i}" for i in range(1, 27)]
    avazu = load_spec("avazu")
    assert avazu.label == "click" and avazu.header and avazu.delimiter == ","
    assert "id" not in [c.name for c in avazu.categorical]


def test_spec_file_with_multi_valued_feature(tmp_path):
    path = tmp_path / "clicks.toml"
    path.write_text(CUSTOM)
    spec = load_spec(path)
    assert spec.categorical[0].table == "user"  # table defaults to the feature name
    assert spec.categorical[1].multi_valued and spec.categorical[1].table == "tag"
    assert spec.to_json()["categorical"][1] == {
        "name": "tags",
        "table": "tag",
        "multi_valued": True,
        "separator": "|",
    }


def test_unknown_spec_name():
    with pytest.raises(UserError, match="unknown spec 'kriteo'.*criteo"):
        load_spec("kriteo")


def test_missing_spec_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_spec(tmp_path / "nope.toml")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            ("dense_type", "dense_typ"),
            r"unknown config key dense_typ \(did you mean dense_type\?\)",
        ),
        (
            ('name = "user"', 'name = "user"\nsize = 3'),
            r"unknown config key categorical\[0\]\.size",
        ),
        (('dense = ["price"]', 'dense = ["cost"]'), "'cost' is not one of the spec's columns"),
        (
            ('dense = ["price"]', 'dense = ["user"]'),
            "column 'user' is both dense and categorical",
        ),
        (('dense = ["price"]', 'dense = ["price", "price"]'), "dense: 'price' is listed twice"),
        (('"user", "tags"]', '"user", "price"]'), "columns: 'price' is listed twice"),
        (('label = "clicked"\n', ""), r"missing required key label$"),
        (('name = "user"\n', 'table = "users"\n'), r"missing required key categorical\[0\]\.name$"),
        (
            ("header = true", "header = true\nheader_lines = 1"),
            r"unknown config key header_lines \(did you mean header\?\)",
        ),
        (('separator = "|"', 'separator = ""'), "multi_valued needs a one-byte separator"),
        (('delimiter = ","', 'delimiter = ",,"'), "delimiter must be one byte"),
        (('dense_transform = "identity"', 'dense_transform = "log"'), "'log' is not one of"),
        (("header = true", "header = 1"), "expected true or false"),
    ],
)
def test_invalid_spec_files(tmp_path, edit, message):
    path = tmp_path / "bad.toml"
    path.write_text(CUSTOM.replace(*edit, 1))
    with pytest.raises(ConfigError, match=message) as error:
        load_spec(path)
    assert str(error.value).startswith(f"spec {path}: ") and "\n" not in str(error.value)
    assert "FeatureSpec:" not in str(error.value) and "__init__" not in str(error.value)


@pytest.mark.parametrize("dense", ['["price"]', "[]"])
def test_a_spec_without_categorical_features_is_refused(tmp_path, dense):
    """The models embed categorical ids (model.towers needs at least one feature)."""
    path = tmp_path / "dense_only.toml"
    path.write_text(
        CUSTOM.split("[[categorical]]")[0].replace('dense = ["price"]', f"dense = {dense}")
    )
    with pytest.raises(ConfigError, match=re.escape(f"spec {path}: no [[categorical]] feature")):
        load_spec(path)


def test_toml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text('name = "x"\nname = "y"\n')
    with pytest.raises(ConfigError, match=r"broken\.toml.*line 2"):
        load_spec(path)
