# Temporary stand-in for `datasets` on the device machine (learning-curve sweep only; deleted afterwards).
class Dataset:
    def __init__(self, columns):
        self._columns = columns

    @classmethod
    def from_dict(cls, columns):
        return cls(columns)

    def __getitem__(self, key):
        if isinstance(key, str):
            return self._columns[key]
        return {c: v[key] for c, v in self._columns.items()}

    def __len__(self):
        return len(next(iter(self._columns.values())))

    def __iter__(self):
        return (self[i] for i in range(len(self)))
