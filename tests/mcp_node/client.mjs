// The official MCP TypeScript SDK's client (@modelcontextprotocol/sdk), as an agent would
// use it, against cogni-tool's MCP server; run by tests/integration/test_mcp_node_clients.py
// inside a real sandbox.
//
//   node client.mjs stdio              starts `cogni-tool mcp` as its stdio server
//   node client.mjs http URL           speaks streamable HTTP to URL (cogni-tool serve's /mcp)
//
// It lists the tools, calls an allowed one (with progress), a denied one and an unknown
// one, and prints what it saw as one JSON line on stdout. The assertions are the test's.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const [mode, url] = process.argv.slice(2);
let transport;
if (mode === "stdio") {
  // The SDK passes only a few variables to its server by default; the run's gateway
  // variables must be passed on (docs/mcp.md says so).
  transport = new StdioClientTransport({ command: "cogni-tool", args: ["mcp"], env: process.env });
} else if (mode === "http" && url) {
  transport = new StreamableHTTPClientTransport(new URL(url));
} else {
  console.error("usage: node client.mjs stdio | node client.mjs http URL");
  process.exit(2);
}

const client = new Client({ name: "cogni-test-ts-client", version: "1.0.0" });
await client.connect(transport);
const seen = {
  version: client.getServerVersion(),
  capabilities: client.getServerCapabilities(),
  sessionId: transport.sessionId ?? null,
  protocolVersion: transport.protocolVersion ?? null,
  progress: [],
};
seen.tools = (await client.listTools()).tools;
seen.allowed = await client.callTool({ name: "fs.read", arguments: { path: "notes.md" } }, undefined, {
  onprogress: (p) => seen.progress.push([p.progress, p.total]),
});
seen.denied = await client.callTool({ name: "fs.write", arguments: { path: "x.txt", content: "no" } });
seen.unknown = await client.callTool({ name: "no.such.tool", arguments: {} });
await client.ping();
if (mode === "http") {
  await transport.terminateSession(); // DELETE /mcp
  seen.terminated = transport.sessionId === undefined;
}
await client.close();
console.log(JSON.stringify(seen));
