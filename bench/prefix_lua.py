"""Design A of bench/prefix_designs.py (not what SIE ships: its endpoint picker, xds_server/picker, won the
measurement): the prefix key computed in Envoy itself, by a Lua filter, for a route's hash policy.

For a request whose route asks for it (route metadata `envoy.filters.http.lua: {prefix_chars: N}`), the filter reads the buffered
JSON body and takes, in body order, the string values of the keys that carry prompt text (`content` of
chat messages, and `text` parts of multimodal content; `prompt`; SGLang's `text`; `input`), joined, up
to N characters: the start of the prompt, system prompt and first messages first. It sets the header
`x-sie-prefix-key` to that text, base64-encoded (any bytes are safe in a header that way), and the
route's hash policy hashes the header for Envoy's consistent hashing (Maglev with a bounded load). A
request with no prompt text gets no key and is balanced by load alone.

The JSON is scanned, not parsed: strings are read with their escapes as they are (the key only has to be
the same for the same prompt), and scanning stops once N characters are collected or after SCAN_BYTES
of body. Whatever the client sent as `x-sie-prefix-key` is removed first, on every request, so the
header always says what Envoy computed.

Costs (bench/prefix_designs.py): about 0.5 ms of Envoy CPU per request with 10 KB prompts on this
machine. Lua's handle:body() may yield, after which objects taken before it (the headers) are out of
scope: they are fetched again afterwards.
"""

from __future__ import annotations

HEADER = "x-sie-prefix-key"
FILTER = "envoy.filters.http.lua"  # also the route metadata namespace the script reads
METADATA_CHARS = "prefix_chars"
SCAN_BYTES = 262_144  # bytes of body the scan looks at, at most

SCRIPT = f"""
local HEADER = "{HEADER}"
local SCAN_BYTES = {SCAN_BYTES}
local KEYS = {{content = true, prompt = true, text = true, input = true}}

-- The raw characters of the JSON string that starts at s[i] (a quote), and the index after it.
local function read_string(s, i)
  local j = i + 1
  while true do
    local c = string.find(s, '["\\\\]', j)
    if c == nil then return nil, nil end
    if string.sub(s, c, c) == "\\\\" then
      j = c + 2
    else
      return string.sub(s, i + 1, c - 1), c + 1
    end
  end
end

-- In body order, the string values of the prompt keys, joined, up to `limit` characters.
local function prompt_start(s, limit)
  local parts, have, i = {{}}, 0, 1
  while have < limit do
    local q = string.find(s, '"', i, true)
    if q == nil then break end
    local name, after = read_string(s, q)
    if name == nil then break end
    local colon, value = string.match(s, "^%s*():%s*()", after)
    if colon ~= nil and KEYS[name] and string.sub(s, value, value) == '"' then
      local text, next_i = read_string(s, value)
      if text == nil then break end
      parts[#parts + 1] = text
      have = have + #text + 1
      i = next_i
    elseif colon ~= nil then
      i = value
    else
      i = after
    end
  end
  local joined = table.concat(parts, "\\n")
  if #joined > limit then joined = string.sub(joined, 1, limit) end
  return joined
end

-- handle:body() may yield (it waits for the body), after which objects taken before it are out of
-- scope: the headers are fetched again afterwards.
function envoy_on_request(handle)
  handle:headers():remove(HEADER)
  local limit = handle:metadata():get("{METADATA_CHARS}")
  if limit == nil then return end
  local body = handle:body()
  if body == nil then return end
  local n = body:length()
  if n == 0 then return end
  local key = prompt_start(body:getBytes(0, math.min(n, SCAN_BYTES)), tonumber(limit))
  if #key > 0 then
    handle:headers():replace(HEADER, handle:base64Escape(key))
  end
end
"""
