"""Loading chunk caches for a fusion: feeds that hand the fusion loop one layer at a time, read and
decoded ahead of use. What they load is planned by the loading controller, `kvrag.query.plan`.
"""
