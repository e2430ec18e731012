"""musegl-dflash: DFlash speculative decoding with the Muse Glimmer assistant draft model."""
