"""musegl-atem: the ATEM tool-call parser for musegl (``--tool-parser atem``).

The hook implementations live in :mod:`musegl_atem.plugin`; importing this
package is cheap and has no side effects.
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
