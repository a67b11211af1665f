"""coding"""
