"""The JSON Schema dialects a tool schema may declare, and jsonschema's validator for each.

:mod:`musegl_atem.schemas` (preflight: the metaschema check) and
:mod:`musegl_atem.validate` (the arguments a model wrote) both need them.
"""

from __future__ import annotations

import jsonschema

DRAFT7 = "draft7"
DRAFT201909 = "draft2019-09"
DRAFT202012 = "draft2020-12"

#: ``$schema`` URIs (without the trailing ``#``) → dialect.
DIALECT_URIS = {
    "http://json-schema.org/draft-07/schema": DRAFT7,
    "https://json-schema.org/draft/2019-09/schema": DRAFT201909,
    "https://json-schema.org/draft/2020-12/schema": DRAFT202012,
}

#: jsonschema's validator class of each dialect.
BASE_VALIDATORS = {
    DRAFT7: jsonschema.Draft7Validator,
    DRAFT201909: jsonschema.Draft201909Validator,
    DRAFT202012: jsonschema.Draft202012Validator,
}
