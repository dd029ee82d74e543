"""kvxfer.router: the embeddable asyncio router and ``kvxfer router``."""
