"""Views of a resolved spec for people: the architecture diagram (`specc graph`) and the
side-by-side difference of two specs (`specc diff`)."""
