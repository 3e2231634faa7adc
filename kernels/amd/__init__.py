"""AMD variants (MI300X gfx942, MI355X gfx950): `ops.catalog.load_all` imports every module here, and
each registers its variants."""
